"""Padded static decode steps (what CUDA graphs replay), their shape cache, and async batching, on CPU."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from support import random_requests, reference, tiny_gemma2, tiny_mistral
from test_engine import greedy, run_all

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.cache.manager import CacheManager
from jitney.core import events as ev
from jitney.core.graphs import DecodeShape, StaticDecoder, decode_shape, padded
from jitney.core.hooks import hookimpl
from jitney.kernels.torch_paged import TorchPagedAttention


def test_padding_rounds_up_to_the_interval():
    assert [padded(n, 8) for n in (1, 7, 8, 9, 16, 17)] == [8, 8, 8, 16, 16, 24]
    assert padded(5, 0) == padded(5, 1) == 5


def test_decode_shape_pads_rows_and_each_groups_table():
    # KV interval 32 tokens = 8 blocks of 4: tables widen in steps of 8 blocks, never to zero
    assert decode_shape(3, [1, 9], 4, 32, 4) == DecodeShape(4, (8, 16))
    assert decode_shape(4, [8], 4, 32, 4) == DecodeShape(4, (8,))
    assert decode_shape(5, [0], 4, 32, 4) == DecodeShape(8, (8,))
    # an interval shorter than a block still pads to whole blocks
    assert decode_shape(1, [3], 1, 2, 16) == DecodeShape(1, (3,))


class CountingCapture:
    """Stands in for CUDA graph capture: records each capture and replays the forward eagerly."""

    def __init__(self):
        self.captured = []

    def __call__(self, fn):
        self.captured.append(fn)
        return fn


def decoder(llama, capture, max_shapes=64):
    cache = CacheManager(2, 2, 16, 4, 32, torch.float32, torch.device("cpu"))
    for rid in "abc":
        cache.reserve(rid, 10)
    return StaticDecoder(llama, cache, TorchPagedAttention(), 4, 8, capture, max_shapes), cache


def test_graphs_are_cached_by_padded_shape_and_buffer_pair(llama):
    capture = CountingCapture()
    dec, cache = decoder(llama, capture)
    table = cache.block_table("a", 0)
    for rows in (1, 3, 2, 4):  # all pad to 4 rows, 4 blocks (3 held, KV interval 2 blocks); pairs alternate
        st = dec.prepare([5] * rows, [9] * rows, [[table] * rows])
        dec.forward(st)
    assert len(capture.captured) == 2 and dec.replays == 4
    assert {key[1] for key in dec.steps} == {0, 1}
    st = dec.prepare([5] * 5, [9] * 5, [[table] * 5])  # 5 rows: a new shape
    dec.forward(st)
    assert st.shape == DecodeShape(8, (4,)) and len(capture.captured) == 3


def test_the_shape_cache_drops_the_least_recently_used(llama):
    dec, cache = decoder(llama, CountingCapture(), max_shapes=2)
    table = cache.block_table("a", 0)
    first = dec.prepare([1], [0], [[table]])
    dec.prepare([1] * 5, [0] * 5, [[table] * 5])
    dec.prepare([1] * 9, [0] * 9, [[table] * 9])
    assert len(dec.steps) == 2 and first not in dec.steps.values()


def test_fill_pads_rows_into_the_padding_block(llama):
    dec, cache = decoder(llama, CountingCapture())
    ta, tb = cache.block_table("a", 0), cache.block_table("b", 0)
    st = dec.prepare([7, 8], [5, 9], [[ta, tb]])
    pad = cache.pools[0].padding_block
    assert st.input_ids.tolist() == [[7, 8, 0, 0]]
    assert st.positions.tolist() == [5, 9, 0, 0] and st.context.tolist() == [6, 10, 1, 1]
    assert st.tables[0][2:].eq(pad).all() and st.tables[0][0, len(ta):].eq(pad).all()
    assert st.slots[0].tolist() == [ta[1] * 4 + 1, tb[2] * 4 + 1, cache.padding_slot, cache.padding_slot]


def test_padded_logits_equal_the_eager_step(llama):
    work = random_requests(5, llama.config.vocab_size, max_prompt=30, max_new=12, seed=7)
    refs = [reference(llama, p, n) for p, n in work]

    async def run(config):
        async with Engine(llama, config=config) as engine:
            done = await run_all(engine, [greedy(p, n) for p, n in work])
            return [d.token_ids for d in done], engine.executor.static

    plain, none = anyio.run(run, EngineConfig(block_size=4, num_blocks=200))
    padded_out, static = anyio.run(run, EngineConfig(block_size=4, num_blocks=200, q_padding_interval_size=4,
                                                     kv_padding_interval_size=16))
    assert none is None and plain == padded_out == refs
    assert static.replays > 0 and all(k[0].rows % 4 == 0 for k in static.steps)


class StepRecorder:
    """Keeps every `StepCompleted` an engine publishes."""

    def __init__(self):
        self.steps: list[ev.StepCompleted] = []

    @hookimpl
    def jitney_on_events(self, events, engine):
        self.steps.extend(e for e in events if isinstance(e, ev.StepCompleted))


@pytest.mark.parametrize("model_fn", [None, tiny_mistral, tiny_gemma2], ids=["llama", "mistral", "gemma2"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("pad, ahead", [(True, False), (False, True), (True, True)], ids=["padded", "async", "both"])
def test_static_steps_and_async_batching_match_generate(llama, model_fn, backend, pad, ahead):
    model = llama if model_fn is None else model_fn(window=6)
    work = random_requests(4, model.config.vocab_size, max_prompt=20, max_new=16, seed=11)
    refs = [reference(model, p, n) for p, n in work]
    recorder = StepRecorder()
    config = EngineConfig(block_size=4, num_blocks=200, attention_backend=backend, use_async_batching=ahead,
                          q_padding_interval_size=4 if pad else 0, kv_padding_interval_size=8 if pad else 0)

    async def run():
        async with Engine(model, config=config, plugins=[recorder]) as engine:
            done = await run_all(engine, [greedy(p, n) for p, n in work])
            assert engine.num_free_blocks == 200
            return [d.token_ids for d in done]

    assert anyio.run(run) == refs
    assert any(s.ahead for s in recorder.steps) == ahead


async def test_async_batching_with_stops_and_aborts_frees_everything(llama):
    work = random_requests(8, llama.config.vocab_size, max_prompt=15, max_new=30, seed=2)
    refs = [reference(llama, p, n) for p, n in work]
    # Stop on the token each request emits at step 5 (so it ends there, while its next step runs ahead).
    stops = [ref[min(4, len(ref) - 1)] for ref in refs]
    config = EngineConfig(block_size=4, num_blocks=120, use_async_batching=True)
    async with Engine(llama, config=config) as engine:
        victim = Request(list(range(3, 20)), SamplingParams(max_new_tokens=200, ignore_eos=True))
        requests = [Request(p, SamplingParams(max_new_tokens=n, stop_token_ids=[s])) for (p, n), s in zip(work, stops)]

        async def abort_later():
            async with engine.stream(victim) as tokens:
                async for t in tokens:
                    if t.index >= 6:
                        break

        async with anyio.create_task_group() as tg:
            tg.start_soon(abort_later)
            done = await run_all(engine, requests)
        assert engine.num_free_blocks == 120 and not engine.requests
    for out, ref, stop in zip(done, refs, stops):
        assert out.token_ids == ref[: ref.index(stop) + 1]


def test_cuda_graphs_are_off_on_cpu_and_refused_when_asked(llama):
    async def run(config):
        async with Engine(llama, config=config) as engine:
            return engine.executor.static, engine.async_batching

    assert anyio.run(run, EngineConfig(num_blocks=16)) == (None, False)
    with pytest.raises(ValueError, match="use_cuda_graph needs a CUDA device"):
        Engine(llama, config=EngineConfig(num_blocks=16, use_cuda_graph=True))


def test_padded_steps_need_a_backend_with_static_steps(llama):
    class Plain:
        def prepare(self, step):
            return TorchPagedAttention().prepare(step)

    class Provider:
        @hookimpl
        def jitney_register_attention_backends(self, register):
            register("plain", lambda device: Plain())

    config = EngineConfig(num_blocks=16, attention_backend="plain", q_padding_interval_size=4)
    with pytest.raises(ValueError, match="static steps, not Plain"):
        Engine(llama, config=config, plugins=[Provider()])


class FakeSteps:
    """Stands in for `StepExecutor` under `ForwardThread`: a step is a list of input tokens; its forward
    waits for a go-ahead, then samples each input + 1 (or fails on a negative one)."""

    def __init__(self):
        self.go = threading.Event()
        self.ran: list[list[int]] = []
        self.forward_s = 0.0
        self.row_errors: dict[int, str] = {}
        self.row_logprobs: dict = {}

    def set_tokens(self, prepared, token_ids):
        prepared[:] = token_ids

    def forward(self, prepared, started):
        self.go.wait()
        started()
        self.ran.append(list(prepared))
        if any(t < 0 for t in prepared):
            raise ValueError("bad step")
        return [[t + 1] for t in prepared]


def test_forward_thread_chains_a_queued_step_on_the_tokens_of_the_running_one():
    from jitney.core.executor import ForwardThread

    steps = FakeSteps()
    thread = ForwardThread(steps)
    first = thread.submit([1, 2, 3])
    second = thread.then(first, [0, 0], rows=[2, 0])  # entry 0 takes row 2's token, entry 1 row 0's
    assert second is not None and thread.then(first, [0], rows=[0]) is None  # one step queued at a time
    steps.go.set()
    assert first.result(5)[0] == [[2], [3], [4]]
    assert second.result(5)[0] == [[5], [3]] and steps.ran == [[1, 2, 3], [4, 2]]
    assert thread.then(second, [0], rows=[0]) is None  # it has ended: the caller submits instead
    thread.shutdown()


def test_forward_thread_fails_the_queued_step_with_the_running_one():
    from jitney.core.executor import ForwardThread

    steps = FakeSteps()
    thread = ForwardThread(steps)
    first = thread.submit([-1])
    second = thread.then(first, [0], rows=[0])
    steps.go.set()
    for future in (first, second):
        with pytest.raises(ValueError, match="bad step"):
            future.result(5)
    assert steps.ran == [[-1]]  # the queued step never ran
    assert thread.submit([5]).result(5)[0] == [[6]]  # the thread goes on with the next batch
    thread.shutdown()


async def test_async_batching_starts_the_steps_ahead_on_the_forward_thread(llama):
    work = random_requests(3, llama.config.vocab_size, max_prompt=10, max_new=20, seed=4)
    refs = [reference(llama, p, n) for p, n in work]
    recorder = StepRecorder()
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=100, use_async_batching=True), plugins=[recorder]) as engine:
        submitted = []
        submit = engine._forward.submit
        engine._forward.submit = lambda prepared: submitted.append(prepared) or submit(prepared)
        done = await run_all(engine, [greedy(p, n) for p, n in work])
    assert [d.token_ids for d in done] == refs
    # the loop submits the scheduled steps, and an ahead step only when it was too late to queue it: most of
    # them started on the forward thread (here 14 ahead of 16 steps, 1 of them submitted by the loop)
    steps = recorder.steps
    ahead = sum(s.ahead for s in steps)
    submitted_ahead = len(submitted) - (len(steps) - ahead)
    assert ahead > 10 and submitted_ahead < ahead / 2
