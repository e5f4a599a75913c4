"""The daemon's load shows: a bar on a terminal, ``load_progress`` events when piped, under
`failover daemon` and under `failover up` (which polls the daemon's status)."""

from __future__ import annotations

import io
import json
import os
import pty
import signal
import subprocess
import sys

from failover_common.progress import LoadBar, bar_line
from supervisor_helpers import Node, wait_until


def test_bar_line_has_bytes_rate_and_eta():
    line = bar_line("loading", 2_000_000_000, 8_000_000_000, 1.0)
    assert line.startswith("loading [#######.....................] 2.00/8.00 GB  25.0%")
    assert "2.00 GB/s" in line and "ETA 3.0s" in line


def test_a_bar_on_a_terminal_events_elsewhere():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True
    tty, pipe = Tty(), io.StringIO()
    bar, events = LoadBar("x", tty), LoadBar("x", pipe)
    assert (bar.mode, events.mode) == ("bar", "events")
    bar.update(5, 10, 1.0)
    bar.finish(10, 2.0)
    assert tty.getvalue().startswith("\rx [") and tty.getvalue().endswith("ETA 0.0s\x1b[K\n")
    assert pipe.getvalue() == ""  # events go to the log, not the stream


def _events(text: str, name: str) -> list[dict]:
    return [d for line in text.splitlines() if line.startswith("{") and (d := json.loads(line)).get("event") == name]


def test_failover_daemon_piped_logs_progress_events(tiny_model, run_dir):
    d = run_dir / "d"
    d.mkdir(mode=0o700)
    proc = subprocess.Popen([sys.executable, "-m", "failover", "daemon", "--model", str(tiny_model),
                             "--run-dir", str(d), "--dtype", "float32"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_until(lambda: (d / "daemon.ready").exists() or proc.poll() is not None, 60, "the daemon to load")
    finally:
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=30)[0]
    done = _events(out, "load_done")
    assert len(done) == 1 and done[0]["bytes"] > 0 and done[0]["gbps"] is not None, out[-2000:]
    progress = _events(out, "load_progress")  # the first report is logged at once
    assert progress and {"bytes", "total", "gbps", "eta_s"} <= progress[0].keys()
    assert progress[0]["total"] == done[0]["bytes"]


def test_failover_daemon_on_a_terminal_draws_a_bar(tiny_model, run_dir):
    d = run_dir / "d"
    d.mkdir(mode=0o700)
    main, sub = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "failover", "daemon", "--model", str(tiny_model),
                             "--run-dir", str(d), "--dtype", "float32", "--log-level", "warning"],
                            stdin=subprocess.DEVNULL, stdout=sub, stderr=sub, start_new_session=True)
    os.close(sub)
    try:
        wait_until(lambda: (d / "daemon.ready").exists() or proc.poll() is not None, 60, "the daemon to load")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    out = b""
    try:
        while chunk := os.read(main, 65536):
            out += chunk
    except OSError:  # EIO: the terminal's other end is closed
        pass
    os.close(main)
    last = out.decode(errors="replace").replace("\r\n", "\n").split("\r")[-1]
    assert "loading weights [############################]" in last and "100.0%" in last, out[-500:]


def test_failover_up_piped_logs_the_daemons_progress(procs, tiny_model, run_dir):
    node = Node(procs, tiny_model, run_dir)
    try:
        done = _events(node.log(), "load_done")
        assert [d["process"] for d in done] == ["supervisor"], done  # the daemon itself draws nothing
        assert done[0]["bytes"] > 0
    finally:
        node.stop()
