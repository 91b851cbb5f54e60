"""The schedule timeline (`--timeline FILE.png` on `jitney bench` and `jitney simulate`): steps (or seconds, with
``--timeline-axis time``) across, requests down, each cell coloured by what the request was doing — waiting, a
prefill chunk, decoding, offloaded, soft reset — and below, over the same axis, what a cache study reads: the KV
cache's blocks in use, cached (content kept for prefix hits, evictable) and empty, the queue's length, and each
step's prompt tokens found in the cache (hits) and computed (misses) with the blocks it evicted."""

from __future__ import annotations

from jitney.core import events as ev
from jitney.core.hooks import hookimpl

STATES = ("waiting", "decode", "prefill", "offloaded", "soft reset")
COLOURS = ("#e2e8f0", "#3182ce", "#dd6b20", "#805ad5", "#e53e3e")
WAITING, DECODE, PREFILL, OFFLOADED, RESET = range(1, 6)  # 0: not there (not arrived yet, or ended)
"""Numbered by how telling a state is: a binned cell shows its bin's highest (a prefill, where misses show, over
the decodes around it)."""


class ScheduleTimeline:
    """An observer that keeps, per request, the runs of steps it spent in each state, and per step the cache's
    blocks, the queue's length, the prefix cache's hits and misses and the blocks evicted. A step's events arrive
    in one batch ending with its `StepCompleted`."""

    def __init__(self) -> None:
        self.rows: dict[str, list[list[int]]] = {}  # request id -> [[first step, last step, state], ...]
        self.kv_usage: list[float] = []  # share of the blocks in use
        self.cached: list[float] = []  # share cached (no owner, content kept)
        self.waiting: list[int] = []
        self.hits: list[int] = []  # prompt tokens found in the prefix cache, of the requests that started
        self.misses: list[int] = []  # the rest of their prompt tokens
        self.evicted: list[int] = []  # cached blocks whose content was dropped
        self.times: list[float] = []  # each step's end, on the engine's clock (simulated seconds in a simulation)
        self.start: float | None = None  # the first event's time

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
            if self.start is None:
                self.start = e.t
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
                total = max(1, e.total_blocks)
                self.kv_usage.append(1 - e.free_blocks / total)
                self.cached.append(e.cached_blocks / total)
                self.waiting.append(e.waiting)
                self.hits.append(e.prefix_hit_tokens)
                self.misses.append(e.prefix_query_tokens - e.prefix_hit_tokens)
                self.evicted.append(e.blocks_demoted)
                self.times.append(e.t)

    def cells(self, max_rows: int = 400, max_cols: int = 1000, axis: str = "step"):
        """The schedule as a grid of states (requests down, columns across; up to `max_rows` and `max_cols`, binned
        beyond: a cell holds its bin's most telling state), with each step's start and end on `axis`: "step" (each
        step one unit) or "time" (seconds since the first event: a step from the end of the one before to its own)."""
        import numpy as np

        if axis not in ("step", "time"):
            raise ValueError(f"timeline axis {axis!r}: 'step' or 'time'")
        steps = max(1, self.step)
        if axis == "time" and self.times:
            ends = np.asarray(self.times) - (self.start or 0.0)
            starts = np.concatenate([[0.0], ends[:-1]])
        else:
            starts, ends = np.arange(steps, dtype=float), np.arange(1, steps + 1, dtype=float)
        span = max(float(ends[-1]), 1e-9)
        rows = list(self.rows.values())
        height, width = max(1, min(len(rows), max_rows)), min(steps, max_cols)

        def column(step: int) -> int:
            return min(width - 1, int(starts[min(step, steps - 1)] * width / span))

        grid = np.zeros((height, width), dtype=np.int8)
        for r, runs in enumerate(rows):
            y = r * height // max(1, len(rows))
            for first, last, state in runs:
                last = steps - 1 if last < 0 else min(last, steps - 1)
                cell = grid[y, column(first) : column(last) + 1]
                np.maximum(cell, state, out=cell)  # (states are numbered by how telling they are)
        return grid, starts, ends

    def draw(self, path: str, title: str = "", max_rows: int = 400, max_cols: int = 1000, axis: str = "step") -> None:
        """Write the chart to `path` (PNG): the schedule (`cells`) over the cache's blocks, the queue, and the
        prefix cache's hits, misses and evictions, on the same `axis`."""
        grid, starts, ends = self.cells(max_rows, max_cols, axis)
        try:
            import matplotlib
        except ImportError:
            raise SystemExit("--timeline needs matplotlib: pip install 'jitney[bench]'") from None
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
        from matplotlib.colors import ListedColormap
        from matplotlib.patches import Patch

        span, rows = float(ends[-1]), len(self.rows)
        fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(12, 9), sharex=True,
                                                  gridspec_kw={"height_ratios": [3, 1, 1]})
        top.imshow(grid, aspect="auto", interpolation="nearest", cmap=ListedColormap(("#ffffff", *COLOURS)),
                   vmin=0, vmax=len(STATES), extent=(0, span, rows, 0))
        top.set_ylabel(f"requests ({rows}, in arrival order)")
        top.legend(handles=[Patch(color=c, label=s) for s, c in zip(STATES, COLOURS)], loc="upper right",
                   fontsize=8, ncol=len(STATES))
        top.set_title(title or "schedule timeline")
        n = len(self.kv_usage)
        x, widths = starts[:n], (ends - starts)[:n]
        edges = np.append(x, ends[n - 1]) if n else x  # (each step's start, then the last one's end)
        used, cached = (np.append(a, a[-1:]) for a in (np.asarray(self.kv_usage), np.asarray(self.cached)))
        middle.fill_between(edges, 0, used, step="post", color="#2b6cb0", label="in use")
        middle.fill_between(edges, used, used + cached, step="post", color="#90cdf4", label="cached (the rest empty)")
        middle.set_ylim(0, 1.0)
        middle.set_ylabel("KV blocks")
        middle.legend(loc="upper left", fontsize=8, ncol=2)
        queue = middle.twinx()
        queue.plot(x, self.waiting, color="#c05621", drawstyle="steps-post", label="waiting")
        queue.set_ylabel("waiting requests")
        bottom.bar(x, self.hits, widths, align="edge", color="#38a169", label="prompt tokens hit")
        bottom.bar(x, self.misses, widths, bottom=self.hits, align="edge", color="#dd6b20", label="missed (computed)")
        bottom.set_ylabel("prefix lookups")
        evicted = bottom.twinx()
        evicted.plot(x, self.evicted, color="#e53e3e", drawstyle="steps-post", label="blocks evicted")
        evicted.set_ylabel("blocks evicted")
        handles = [*bottom.get_legend_handles_labels()[0], *evicted.get_legend_handles_labels()[0]]
        bottom.legend(handles=handles, loc="upper left", fontsize=8, ncol=3)
        bottom.set_xlabel("seconds" if axis == "time" else "step")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
