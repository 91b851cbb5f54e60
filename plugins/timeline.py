"""The schedule timeline (`--timeline FILE.png` on `jitney bench` and `jitney simulate`): steps across, requests
down, each cell coloured by what the request was doing — waiting, a prefill chunk, decoding, offloaded, soft
reset — with KV-cache usage and queue length over the same steps below."""

from __future__ import annotations

from jitney.core import events as ev
from jitney.core.hooks import hookimpl

STATES = ("waiting", "prefill", "decode", "offloaded", "soft reset")
COLOURS = ("#e2e8f0", "#dd6b20", "#3182ce", "#805ad5", "#e53e3e")
WAITING, PREFILL, DECODE, OFFLOADED, RESET = range(1, 6)  # 0: not there (not arrived yet, or ended)


class ScheduleTimeline:
    """An observer that keeps, per request, the runs of steps it spent in each state, and per step the cache's
    usage and the queue's length. A step's events arrive in one batch ending with its `StepCompleted`."""

    def __init__(self) -> None:
        self.rows: dict[str, list[list[int]]] = {}  # request id -> [[first step, last step, state], ...]
        self.kv_usage: list[float] = []
        self.waiting: list[int] = []

    @property
    def step(self) -> int:
        return len(self.kv_usage)  # the step whose events are coming in

    def _enter(self, request_id: str, state: int, at: int | None = None) -> None:
        runs = self.rows.setdefault(request_id, [])
        at = self.step if at is None else at
        if runs and runs[-1][2] == state:
            return
        if runs and runs[-1][1] < 0:
            runs[-1][1] = max(runs[-1][0], at - 1)
        runs.append([at, -1, state])

    def _leave(self, request_id: str) -> None:
        runs = self.rows.get(request_id)
        if runs and runs[-1][1] < 0:
            runs[-1][1] = max(runs[-1][0], self.step)

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            rid = getattr(e, "request_id", None)
            if isinstance(e, ev.RequestQueued):
                self._enter(rid, WAITING)
            elif isinstance(e, (ev.PrefillStarted, ev.PrefillChunk)):
                self._enter(rid, PREFILL)
            elif isinstance(e, ev.FirstToken):
                self._enter(rid, PREFILL)
                self._enter(rid, DECODE, self.step + 1)
            elif isinstance(e, ev.TokensGenerated) and rid not in self.rows:
                self._enter(rid, DECODE)  # (a further sample: it forked from its parent's prompt)
            elif isinstance(e, ev.RequestOffloaded):
                self._enter(rid, OFFLOADED)
            elif isinstance(e, ev.RequestResumed):
                self._enter(rid, DECODE)
            elif isinstance(e, ev.RequestSoftReset):
                self._enter(rid, RESET)
                self._enter(rid, WAITING, self.step + 1)
            elif isinstance(e, ev.RequestFinished):
                self._leave(rid)
            elif isinstance(e, ev.StepCompleted):
                self.kv_usage.append(1 - e.free_blocks / e.total_blocks)
                self.waiting.append(e.waiting)

    def draw(self, path: str, title: str = "", max_rows: int = 400, max_cols: int = 1000) -> None:
        """Write the chart to `path` (PNG). Up to `max_rows` requests and `max_cols` steps each has its own
        row and column; beyond, they are binned (a cell shows its bin's most telling state)."""
        try:
            import matplotlib
        except ImportError:
            raise SystemExit("--timeline needs matplotlib: pip install 'jitney[bench]'") from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch

        steps = max(1, self.step)
        rows = list(self.rows.values())
        height, width = max(1, min(len(rows), max_rows)), min(steps, max_cols)
        grid = np.zeros((height, width), dtype=np.int8)
        for r, runs in enumerate(rows):
            y = r * height // max(1, len(rows))
            for first, last, state in runs:
                last = steps - 1 if last < 0 else min(last, steps - 1)
                a, b = first * width // steps, last * width // steps + 1
                cell = grid[y, a:b]
                np.maximum(cell, state, out=cell)  # (states are numbered by how telling they are)
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
        top.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(("#ffffff", *COLOURS)),
                   vmin=0, vmax=len(STATES), extent=(0, steps, len(rows), 0))
        top.set_ylabel(f"requests ({len(rows)}, in arrival order)")
        top.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATES, COLOURS)], loc="upper right",
                   fontsize=8, ncol=len(STATES))
        top.set_title(title or "schedule timeline")
        x = np.arange(len(self.kv_usage))
        bottom.plot(x, self.kv_usage, color="#2b6cb0", label="KV cache in use")
        bottom.set_ylim(0, 1.05)
        bottom.set_ylabel("KV in use")
        queue = bottom.twinx()
        queue.plot(x, self.waiting, color="#c05621", label="waiting")
        queue.set_ylabel("waiting requests")
        bottom.set_xlabel("step")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
