"""A PNG timeline of a bench run: the tokens each client request received over time around each
fault, with the kill, the router's detection, the switch, its first good response and the relaunch
marked. Needs matplotlib (``pip install -e '.[plots]'``); the benches' ``--png PATH`` calls
:func:`write`. Also a command, for a ``bench/failover.py --dump`` file:

    python bench/timeline_png.py PREFIX.SIGKILL.json out.png

Inputs, all on one monotonic clock: ``records`` as client_figures' (start, end, ok, stream, tokens);
``faults`` the fault instants; ``marks`` per fault a dict of name -> instant (``detected``,
``switched``, ``first_ok``, ``relaunched``), any of them missing.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

MARKS = (("kill", "red", "-"), ("detected", "darkorange", "--"), ("switched", "purple", ":"),
         ("first_ok", "royalblue", "-."), ("relaunched", "green", "--"))
ZOOM = (-0.5, 2.5)  # seconds around each fault in the zoomed panels
MAX_ZOOMS = 4


def write(path: str | Path, records: Sequence, faults: Sequence[float], marks: Sequence[dict] = (),
          title: str = "") -> Path:
    """Draw and save; returns the path. Raises SystemExit with a hint when matplotlib is absent."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png needs matplotlib: pip install -e '.[plots]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = sorted(records, key=lambda r: r.start)
    t0 = min([r.start for r in records] + list(faults) or [0.0])
    zooms = list(faults[:MAX_ZOOMS])
    fig = plt.figure(figsize=(14, 4 + 3.2 * bool(zooms)), dpi=110)
    grid = fig.add_gridspec(2 if zooms else 1, max(len(zooms), 1), height_ratios=[1, 1.1] if zooms else [1])
    whole = fig.add_subplot(grid[0, :])
    _draw(whole, records, faults, marks, t0, None)
    whole.set_title(title or "tokens received by each client request (one row per request)")
    for i, fault in enumerate(zooms):
        ax = fig.add_subplot(grid[1, i])
        _draw(ax, records, [fault], [marks[i]] if i < len(marks) else [], fault, ZOOM)
        ax.set_title(f"fault {i + 1}: ms after the kill", fontsize=9)
    handles = [plt.Line2D([], [], color=c, linestyle=s, label=n) for n, c, s in MARKS]
    handles.append(plt.Line2D([], [], color="black", marker="|", linestyle="", label="token / answer"))
    handles.append(plt.Line2D([], [], color="red", marker="x", linestyle="", label="failed request"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw(ax, records, faults, marks, origin: float, window: tuple[float, float] | None) -> None:
    scale = 1e3 if window else 1.0  # zoomed panels in ms after their fault, the whole run in s
    lo, hi = (origin + window[0], origin + window[1]) if window else (float("-inf"), float("inf"))
    rows = [r for r in records if r.end >= lo and r.start <= hi]
    xs, ys, bad_x, bad_y = [], [], [], []
    for y, r in enumerate(rows):
        times = list(r.tokens) if r.stream else ([r.end] if r.ok else [])
        for t in times:
            if lo <= t <= hi:
                xs.append((t - origin) * scale)
                ys.append(y)
        ax.plot([(max(r.start, lo) - origin) * scale, (min(r.end, hi) - origin) * scale], [y, y],
                color="0.85", linewidth=0.6, zorder=1)
        if not r.ok and lo <= r.end <= hi:
            bad_x.append((r.end - origin) * scale)
            bad_y.append(y)
    ax.scatter(xs, ys, marker="|", s=12, color="black", linewidths=0.6, zorder=2)
    ax.scatter(bad_x, bad_y, marker="x", s=20, color="red", zorder=3)
    for i, fault in enumerate(faults):
        points = {"kill": fault, **(marks[i] if i < len(marks) else {})}
        for name, color, style in MARKS:
            if points.get(name) is not None:
                ax.axvline((points[name] - origin) * scale, color=color, linestyle=style, linewidth=1, zorder=4)
    ax.set_xlabel("ms after the kill" if window else "seconds since the load started")
    ax.set_ylabel("request")
    if window:
        ax.set_xlim(window[0] * scale, window[1] * scale)


def marks_from_router(records: Sequence[dict]) -> list[dict]:
    """Marks from the router's failover records (``Promoter.last_failover`` values, monotonic)."""
    out = []
    for rec in records:
        m = rec.get("monotonic") or {}
        out.append({"detected": m.get("detected"), "switched": m.get("switched"), "first_ok": m.get("first_ok"),
                    "relaunched": rec.get("relaunched")})
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python bench/timeline_png.py DUMP.json OUT.png", file=sys.stderr)
        return 2
    dump = json.loads(Path(argv[0]).read_text())
    records = [SimpleNamespace(**o) for o in dump["outcomes"]]
    write(argv[1], records, dump["faults"], marks_from_router(dump["router"]), title=Path(argv[0]).stem)
    print(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
