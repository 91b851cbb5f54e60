"""Memory pressure: the swap pool, soft reset, retry within a step, and a long randomized run with no leaks."""

from __future__ import annotations

import random

import anyio
import pytest
from support import random_requests, reference, tiny_gemma2

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core.hooks import hookimpl
from jitney.core.request import RequestStatus
from jitney.core.sequence import Sequence


class Recorder:
    def __init__(self):
        self.kinds: dict[str, list] = {}

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            self.kinds.setdefault(type(e).__name__, []).append(e)


def greedy(prompt, n):
    return Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))


async def run_all(engine, requests):
    out = {}

    async def one(i, req):
        out[i] = await engine.generate(req)

    async with anyio.create_task_group() as tg:
        for i, r in enumerate(requests):
            tg.start_soon(one, i, r)
    return [out[i] for i in range(len(requests))]


# 10 requests of up to 40 + 30 tokens in 24 blocks of 4: far less than they need together.
WORK = random_requests(10, 256, max_prompt=40, max_new=30, seed=21)
TIGHT = dict(block_size=4, num_blocks=24, max_batch_tokens=32, safety_margin=0.0, allow_block_sharing=False)


@pytest.mark.parametrize("space, path", [(0.01, "RequestOffloaded"), (0.0, "RequestSoftReset")])
async def test_tokens_are_unchanged_under_memory_pressure(llama, space, path):
    refs = [reference(llama, p, n) for p, n in WORK]
    rec = Recorder()
    async with Engine(llama, config=EngineConfig(cpu_offload_space=space, **TIGHT), plugins=[rec]) as engine:
        done = await run_all(engine, [greedy(p, n) for p, n in WORK])
        assert engine.num_free_blocks == 24
        swap = engine.preempter.backend
        assert swap is None or swap.free_blocks() == swap.num_blocks
    assert [d.token_ids for d in done] == refs
    assert rec.kinds.get(path)
    if path == "RequestOffloaded":
        assert len(rec.kinds["RequestResumed"]) == len(rec.kinds["RequestOffloaded"])
        assert not rec.kinds.get("RequestSoftReset")  # the pool had room for everything
    else:
        assert not rec.kinds.get("RequestOffloaded")
    steps = rec.kinds["StepCompleted"]
    assert sum(s.preemptions for s in steps) == len(rec.kinds.get("RequestOffloaded", [])) + len(rec.kinds.get("RequestSoftReset", []))


async def test_cache_fills_and_swap_copies_run_on_the_forward_thread(llama, monkeypatch):
    """Parallel torch work on the event loop's thread leaves it an OpenMP team, which slows every forward
    after it (`kernels/native.py`): the engine's own torch work on the cache stays on the forward thread."""
    import threading

    from jitney.cache.manager import CacheManager
    from jitney.cache.offload import CpuSwapPool

    threads = []
    for cls, name in ((CacheManager, "zero_blocks"), (CpuSwapPool, "_copy")):
        original = getattr(cls, name)

        def recorded(*args, _original=original, _name=name, **kwargs):
            threads.append((_name, threading.current_thread().name))
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)
    rec = Recorder()
    async with Engine(llama, config=EngineConfig(cpu_offload_space=0.01, **TIGHT), plugins=[rec]) as engine:
        await run_all(engine, [greedy(p, n) for p, n in WORK])
    assert rec.kinds.get("RequestOffloaded") and rec.kinds.get("RequestResumed")
    assert {name for name, _ in threads} == {"zero_blocks", "_copy"}
    assert all(thread.startswith("jitney-forward") for _, thread in threads), set(threads)


def decoding(engine: Engine, prompt_len: int, arrival: int) -> Sequence:
    """An active request in the middle of decoding, holding exactly the blocks of its tokens so far."""
    seq = Sequence(greedy([5] * prompt_len, 50), [5] * prompt_len, frozenset(), arrival)
    seq.output_ids = [6]
    seq.num_computed = prompt_len
    seq.status = RequestStatus.DECODING
    assert engine.cache.reserve(seq.request_id, prompt_len)
    engine.active.append(seq)
    engine.requests[seq.request_id] = seq.collector
    return seq


async def test_when_nothing_fits_the_newest_are_preempted_and_the_step_retried(llama):
    config = EngineConfig(block_size=4, num_blocks=12, safety_margin=0.0, cpu_offload_space=0.01)
    async with Engine(llama, config=config) as engine:
        a, b, c = [decoding(engine, 16, i) for i in range(3)]  # 4 blocks each, all full: each needs a 5th
        assert engine.num_free_blocks == 0
        batch = engine._schedule()  # nothing fits: the newest is offloaded, then the step is scheduled again
        assert [s for s, _ in batch.entries] == [a, b]
        assert engine.preempter.offloaded == [c]
        for s in (a, b, c):
            engine.abort(s.request_id)
        assert engine.num_free_blocks == 12


async def test_the_last_active_request_is_never_preempted(llama):
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=12, safety_margin=0.0)) as engine:
        only = decoding(engine, 16, 0)
        assert not engine.preempter.relieve(100, keep=set())
        assert engine.active == [only]
        others = [decoding(engine, 8, i) for i in (1, 2)]
        assert engine.preempter.relieve(100, keep=set())
        assert engine.active == [only]  # newest first, down to the last one
        assert [s.status for s in others] == [RequestStatus.PENDING] * 2  # soft reset: no offload backend
        engine.abort(only.request_id)


async def test_stalled_requests_free_room_outside_the_steps_batch(llama):
    config = EngineConfig(block_size=4, num_blocks=13, safety_margin=0.0, cpu_offload_space=0.01)
    async with Engine(llama, config=config) as engine:
        a = decoding(engine, 15, 0)  # 4 blocks, room for its next token
        b = decoding(engine, 16, 1)  # full: needs a 5th block, and gets the last free one
        c = decoding(engine, 16, 2)  # full: stalls
        assert engine.num_free_blocks == 1
        batch = engine._schedule()
        assert [s for s, _ in batch.entries] == [a, b]
        assert all(engine.cache.holds(s.request_id) for s in (a, b))  # the step's batch keeps its cache
        assert engine.preempter.offloaded == [c]  # the stalled one is offloaded, ready to resume
        for s in [a, b, c]:
            engine.abort(s.request_id)
        assert engine.num_free_blocks == 13 and engine.preempter.backend.free_blocks() == engine.preempter.backend.num_blocks


@pytest.mark.parametrize("count", [1000, pytest.param(10_000, marks=pytest.mark.nightly)])
async def test_randomized_requests_and_cancellations_lose_nothing_and_leak_nothing(llama, count):
    rng = random.Random(count)
    # A swap pool for only a few requests: both offloading and soft resets happen.
    config = EngineConfig(block_size=4, num_blocks=48, max_batch_tokens=64, max_requests_per_batch=16,
                          cpu_offload_space=40e-6, safety_margin=0.05)  # about 20 blocks of swap
    rec = Recorder()
    outcome: dict[str, str] = {}
    checked: list[tuple[list[int], list[int]]] = []
    async with Engine(llama, config=config, plugins=[rec]) as engine:
        async def one(i: int) -> None:
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 40))]
            req = greedy(prompt, rng.randint(1, 40))
            stop_after = rng.randint(1, 20) if rng.random() < 0.2 else None
            async with engine.stream(req) as stream:
                async for tok in stream:
                    if stop_after is not None and len(stream.collector.samples[0].output_ids) >= stop_after:
                        break
            done = stream.completion()
            outcome[stream.request_id] = done.finish_reason
            if done.finish_reason == "length" and i % 50 == 0:
                checked.append((prompt, done.token_ids))

        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(one, i)
                if i % 25 == 0:
                    await anyio.sleep(0.01)
        assert not engine.requests and not engine.active and not engine.waiting and not engine.preempter.offloaded
        assert engine.num_free_blocks == 48  # nothing leaked in the device pool
        swap = engine.preempter.backend
        assert swap.free_blocks() == swap.num_blocks  # nor in the swap pool
    assert len(outcome) == count
    assert set(outcome.values()) <= {"length", "cancelled"}
    assert rec.kinds.get("RequestOffloaded") and rec.kinds.get("RequestSoftReset")
    for prompt, tokens in checked:
        assert tokens == reference(llama, prompt, len(tokens))


async def test_sliding_window_models_soft_reset_under_pressure():
    model = tiny_gemma2(window=8)
    refs = [reference(model, p, n) for p, n in WORK]
    rec = Recorder()
    async with Engine(model, config=EngineConfig(cpu_offload_space=0.01, **TIGHT), plugins=[rec]) as engine:
        done = await run_all(engine, [greedy(p, n) for p, n in WORK])
        assert engine.num_free_blocks == 24
    assert [d.token_ids for d in done] == refs
    assert rec.kinds.get("RequestSoftReset") and not rec.kinds.get("RequestOffloaded")
