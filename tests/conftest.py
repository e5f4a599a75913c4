"""Fixtures every test may use: a tiny checkpoint, free ports, a private run dir, process cleanup."""

from __future__ import annotations

import contextlib

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from failover_common import ports
from failover.tools.tiny_model import TinySpec, write_checkpoint

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    return ports.free_port()


def has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


_TMP: dict[str, str] = {}


def pytest_configure(config):
    """The suite's temp dir is its own, so what a test or the processes it starts leave in the temp
    dir is seen (``pytest_sessionfinish``), whatever else runs on the machine. Pytest's own temp
    dirs (``tmp_path``) stay where they were: sockets go in some of them, and AF_UNIX paths are short."""
    if "TMPDIR" in _TMP or hasattr(config, "workerinput"):
        return
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
    _TMP["was"] = os.environ.get("TMPDIR", "")
    _TMP["TMPDIR"] = os.environ["TMPDIR"] = tmp = tempfile.mkdtemp(prefix="fo-suite-tmp-")
    os.chmod(tmp, 0o1777)  # as /tmp: tests that drop to another uid make their files there too
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_sessionfinish(session, exitstatus):
    tmp = _TMP.pop("TMPDIR", None)
    if tmp is None:
        return
    if was := _TMP.pop("was", ""):
        os.environ["TMPDIR"] = was
    else:
        os.environ.pop("TMPDIR", None)
    tempfile.tempdir = None
    # torch's compile cache, made by the test process itself (transformers, the logits' reference,
    # reaches it): a cache torch keeps in the temp dir by design, not a leak of ours
    left = sorted(f for f in os.listdir(tmp) if not f.startswith("torchinductor_"))
    shutil.rmtree(tmp, ignore_errors=True)
    if left:
        print(f"\nleft in the temp dir by the tests or their processes ({len(left)}): {left[:10]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(config, items):
    if has_cuda():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer Llama checkpoint in two safetensors files (shared, read-only by convention)."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"), TinySpec(shards=2))


@pytest.fixture
def run_dir():
    """A private (0700) run directory, short enough for AF_UNIX paths, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="fo-", dir="/tmp"))
    os.chmod(d, 0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Procs:
    """Starts named child processes for a test and ends every one of them (TERM, then KILL)."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen] = []
        self.files: list[Path] = []

    def temp_file(self, prefix: str, suffix: str = ".log") -> tuple[int, Path]:
        """An open temp file (fd, path) for a child's output, removed by stop_all()."""
        fd, path = tempfile.mkstemp(prefix=prefix, suffix=suffix)
        self.files.append(Path(path))
        return fd, Path(path)

    def start(self, args: list[str], **kw) -> subprocess.Popen:
        kw.setdefault("start_new_session", True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", **kw.pop("env", {}))
        proc = subprocess.Popen(args, env=env, cwd=kw.pop("cwd", REPO), **kw)
        self.started.append(proc)
        return proc

    def python(self, *args: str, **kw) -> subprocess.Popen:
        return self.start([sys.executable, *args], **kw)

    def stop_all(self, timeout: float = 10.0) -> None:
        for proc in self.started:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
        for proc in self.started:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
            # the group may hold grandchildren even after the leader exited
            _signal_group(proc, signal.SIGKILL)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for path in self.files:
            path.unlink(missing_ok=True)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.stop_all()


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str = "64k"):
    """A real, tiny filesystem (a full disk on demand) mounted at ``mnt``; unmounted afterwards.
    Skips the test where mounting is not allowed."""
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(mnt)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
