"""Static-shape decode steps, for CUDA graphs.

A graph replays fixed kernels on fixed buffers, so a decode step is padded to a shape from a small set:
its rows (one query token each) to a multiple of `q_padding_interval_size`, each layer group's block table
to a multiple of `kv_padding_interval_size` tokens. Each padded shape gets its own input buffers and, on
CUDA, a graph captured on first use and replayed after; steps alternate between two buffer pairs so that
the next step's inputs can be written while the current one runs (async batching).

Padding rows decode token 0 at position 0 through a table of padding blocks: they write into and read
from the reserved padding slot, whose values stay finite, and their logits are dropped.
Prefill and mixed steps run eagerly: their cost is in the matmuls, not in kernel launches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from jitney.cache.manager import CacheManager
from jitney.kernels.base import STEP_KWARG, AttentionBackend, StepInputs, int_table, int_tensor


def padded(n: int, interval: int) -> int:
    """`n` rounded up to a multiple of `interval` (0 or 1: `n` itself)."""
    return -(-n // interval) * interval if interval > 1 else n


@dataclass(frozen=True)
class DecodeShape:
    """A padded decode step: `rows` query tokens, block tables `widths` blocks wide (one per layer group)."""

    rows: int
    widths: tuple[int, ...]


def decode_shape(rows: int, widths: list[int], q_interval: int, kv_interval: int, block_size: int) -> DecodeShape:
    kv_blocks = max(1, -(-kv_interval // block_size))  # the KV interval in whole blocks
    return DecodeShape(padded(rows, q_interval), tuple(padded(max(w, 1), kv_blocks) for w in widths))


class StaticDecodeStep:
    """The buffers of one padded shape (one of the two pairs), and the forward that reads them."""

    def __init__(self, shape: DecodeShape, cache: CacheManager, device: torch.device):
        self.shape = shape
        self.cache = cache
        r = shape.rows
        long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(1, r, **long)
        self.positions = torch.zeros(r, **long)
        self.context = torch.ones(r, **long)
        self.tables = [torch.full((r, w), pool.padding_block, **long) for w, pool in zip(shape.widths, cache.pools)]
        self.slots = [torch.full((r,), cache.padding_slot, **long) for _ in shape.widths]
        self.step = StepInputs(
            query_lens=[1] * r, context_lens=[], num_decodes=r, positions=self.positions, block_tables=self.tables,
            group_of_layer=cache.group_of_layer, block_size=cache.block_size, padding_slot=cache.padding_slot,
            keys=cache.keys, values=cache.values, static=True,
        )
        self.step.context_tensor = self.context
        self.step.write_slots = self.slots
        self.num_rows = 0  # real rows of the latest fill
        self.replay: Callable[[], torch.Tensor] | None = None  # set once captured (or bound eagerly)

    def fill(self, ids: list[int], positions: list[int], tables: list[list[list[int]]]) -> None:
        """Write a step's rows (token, position, per group its block table) into the buffers, padding the rest."""
        r, bs, n = self.shape.rows, self.cache.block_size, len(ids)
        pad_rows = r - n
        self.input_ids[0].copy_(int_tensor(ids + [0] * pad_rows))
        self.positions.copy_(int_tensor(positions + [0] * pad_rows))
        self.context.copy_(int_tensor([p + 1 for p in positions] + [1] * pad_rows))
        for g, (width, pool) in enumerate(zip(self.shape.widths, self.cache.pools)):
            self.tables[g].copy_(int_table(tables[g], width, pool.padding_block, r))
            slots = [t[p // bs] * bs + p % bs for t, p in zip(tables[g], positions)]
            self.slots[g].copy_(int_tensor(slots + [self.cache.padding_slot] * pad_rows))
        self.num_rows = n


def eager(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """The capture strategy off CUDA: no graph, `fn` itself runs on each replay."""
    return fn


class CudaGraphCapture:
    """Captures a forward into a CUDA graph on `stream`; every graph shares one memory pool."""

    def __init__(self, stream: torch.cuda.Stream):
        self.stream = stream
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # warm-up: compiles Triton kernels, settles allocator state outside the capture
        self.stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = fn()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class StaticDecoder:
    """Padded decode steps with their buffers (and graphs), cached by padded shape and buffer pair.

    `capture` turns a forward into something to replay: `CudaGraphCapture` on CUDA, `eager` elsewhere (the
    shapes and buffers are the same, which is how the CPU tests cover this path). At most `max_shapes`
    shapes are kept; the least recently used is dropped first.
    """

    def __init__(self, model: torch.nn.Module, cache: CacheManager, backend: AttentionBackend, q_interval: int,
                 kv_interval: int, capture: Callable = eager, max_shapes: int = 64):
        self.model, self.cache, self.backend = model, cache, backend
        self.q_interval, self.kv_interval = q_interval, kv_interval
        self.capture = capture
        self.max_shapes = max_shapes
        self.device = next(model.parameters()).device
        self.steps: OrderedDict[tuple[DecodeShape, int], StaticDecodeStep] = OrderedDict()
        self.pair = 0
        self.captures = 0
        self.replays = 0

    def prepare(self, ids: list[int], positions: list[int], tables: list[list[list[int]]]) -> StaticDecodeStep:
        """Fill the buffers of this step's padded shape, in the pair the previous step did not use."""
        shape = decode_shape(len(ids), [max(map(len, t)) for t in tables], self.q_interval, self.kv_interval,
                             self.cache.block_size)
        self.pair ^= 1
        key = (shape, self.pair)
        st = self.steps.get(key)
        if st is None:
            st = self.steps[key] = StaticDecodeStep(shape, self.cache, self.device)
            while len(self.steps) > self.max_shapes:
                self.steps.popitem(last=False)
        self.steps.move_to_end(key)
        st.fill(ids, positions, tables)
        return st

    def forward(self, st: StaticDecodeStep) -> torch.Tensor:
        """Run (capturing on first use) the padded step; return the real rows' logits [rows, vocab]."""
        if st.replay is None:
            st.replay = self.capture(lambda: self._forward(st))
            self.captures += 1
        self.replays += 1
        return st.replay()[: st.num_rows]

    def _forward(self, st: StaticDecodeStep) -> torch.Tensor:
        out = self.model(input_ids=st.input_ids, position_ids=st.positions[None], use_cache=False,
                         **{STEP_KWARG: self.backend.prepare(st.step)})
        return out.logits[0]
