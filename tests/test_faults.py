"""Faults stay where they start: a plugin, a request or a sampling parameter that misbehaves fails what it
concerns, is logged with its name, and the engine keeps serving with every block returned."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest
from support import reference, tiny_llama

from jitney import Engine, EngineConfig, Request, RequestError, SamplingParams
from jitney.cache.offload import CpuSwapPool
from jitney.core import events as ev
from jitney.core import sampling
from jitney.core.hooks import hookimpl
from jitney.core.request import Priority
from jitney.schedulers.base import Batch
from jitney.schedulers.fifo import FifoScheduler


def greedy(prompt, n, **kw):
    return Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True), **kw)


class Registers:
    """A plugin registering one scheduler, eviction policy or offload backend under a name."""

    def __init__(self, schedulers=None, eviction=None, offload=None):
        self.schedulers, self.eviction, self.offload = schedulers or {}, eviction or {}, offload or {}

    @hookimpl
    def jitney_register_schedulers(self, register):
        for name, factory in self.schedulers.items():
            register(name, factory)

    @hookimpl
    def jitney_register_eviction_policies(self, register):
        for name, factory in self.eviction.items():
            register(name, factory)

    @hookimpl
    def jitney_register_offload_backends(self, register):
        for name, factory in self.offload.items():
            register(name, factory)


async def outcome(engine: Engine, req: Request) -> tuple[str, list[int] | str]:
    """("ok", tokens) or ("failed", the error's message)."""
    try:
        return "ok", (await engine.generate(req)).token_ids
    except RequestError as exc:
        return "failed", str(exc)


async def run_together(engine: Engine, requests: list[Request]) -> list[tuple[str, list[int] | str]]:
    results: dict[int, tuple] = {}

    async def one(i: int, req: Request) -> None:
        results[i] = await outcome(engine, req)

    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            tg.start_soon(one, i, req)
    return [results[i] for i in range(len(requests))]


def leaks(engine: Engine) -> list[str]:
    """What the cache still holds once every request has ended (nothing, when all is well)."""
    cache = engine.cache
    found = []
    if cache.num_free_blocks != cache.num_blocks:
        found.append(f"{cache.num_blocks - cache.num_free_blocks} blocks not free")
    if cache._tables:
        found.append(f"block tables left: {sorted(cache._tables)}")
    for pool in cache.pools:
        if any(b.ref_count for b in pool.blocks):
            found.append("blocks still referenced")
    if engine.requests or engine.active or engine.waiting or engine.preempter.offloaded:
        found.append("requests left in the engine")
    return found


# -- 1. the priority scheduler with a swap pool -----------------------------------------------------------


async def test_priority_preemption_with_a_swap_pool_makes_progress(llama):
    """An interactive request held back by the safety margin (another interactive one decoding, background
    work holding the cache) used to offload a background request and resume it at once, forever, inside one
    schedule call: the step count froze and no timeout could fire."""
    config = EngineConfig(scheduler="priority", cpu_offload_space=0.01, num_blocks=20, block_size=4)
    first = ([5, 6, 7, 8], 24)
    background = [([(7 * i + j) % 250 + 3 for j in range(12)], 20) for i in range(2)]
    late = ([5, 9, 11, 200, 17, 3, 40, 41], 6)
    refs = [reference(llama, p, n) for p, n in [first, *background, late]]
    async with Engine(llama, config=config) as engine:
        a = engine.stream(greedy(*first, priority=Priority.INTERACTIVE))
        bg = [engine.stream(greedy(p, n, priority=Priority.BACKGROUND)) for p, n in background]
        out_a, late_done = [], None
        async with anyio.create_task_group() as tg:
            async def late_request():
                nonlocal late_done
                late_done = await engine.generate(greedy(*late, priority=Priority.INTERACTIVE))

            async def background_tokens(stream, out):
                out.extend([t.token_id async for t in stream])

            outs = [[] for _ in bg]
            for stream, out in zip(bg, outs):
                tg.start_soon(background_tokens, stream, out)
            with anyio.fail_after(60):
                async for tok in a:
                    out_a.append(tok.token_id)
                    if late_done is None and not tg.cancel_scope.cancel_called and 1 <= engine.num_free_blocks < 3 \
                            and engine.preempter.total == 0 and len(engine.active) == 3:
                        tg.start_soon(late_request)
                        late_done = False
        assert late_done is not False and late_done is not None, "the late request arrived under the margin"
        assert not leaks(engine)
    assert [out_a, *outs, late_done.token_ids] == refs


# -- 2. schedulers that raise or return batches the engine cannot run --------------------------------------


def bad_schedule(kind: str):
    """A FIFO scheduler that misbehaves, once, at its first step with two requests to choose from."""

    class Faulty(FifoScheduler):
        done = False

        def schedule(self, waiting, active, cache):
            batch = super().schedule(waiting, active, cache)
            if self.done or len(waiting) + len(active) < 2 or len(batch.entries) < 2:
                return batch
            self.done = True
            (a, n), (b, m) = batch.entries[:2]
            if kind == "raises":
                raise KeyError("boom")
            if kind == "none":
                return None
            if kind == "empty":
                for seq, _ in batch.entries:  # (undo its reservations, as a scheduler that chose nothing would)
                    if seq in waiting:
                        cache.release(seq.request_id)
                        seq.num_computed = 0
                return Batch()
            if kind == "duplicate":
                return Batch(entries=[(a, n), (a, n), (b, m)])
            if kind == "too many tokens":
                cache.reserve(a.request_id, a.num_computed + a.remaining + 8)
                return Batch(entries=[(a, a.remaining + 8), (b, m)])
            if kind == "unreserved":
                cache.release(b.request_id)
                return Batch(entries=[(a, n), (b, m)])
            if kind == "over budget":  # every prompt whole: 30 tokens, max_batch_tokens is 16
                everyone = active + waiting
                for seq in everyone:
                    cache.reserve(seq.request_id, seq.num_computed + seq.remaining)
                return Batch(entries=[(seq, seq.remaining) for seq in everyone])
            if kind == "not a tuple":
                return Batch(entries=[a, (b, m)])
            raise AssertionError(kind)

    return Faulty


@pytest.mark.parametrize("kind", ["raises", "none", "empty", "duplicate", "too many tokens", "unreserved",
                                  "over budget", "not a tuple"])
async def test_a_faulty_scheduler_fails_its_step_and_the_engine_serves_on(llama, kind, caplog):
    work = [([3 + i, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50][: 6 + i], 6) for i in range(4)]
    later = ([9, 8, 7, 6, 5], 7)
    refs = [reference(llama, p, n) for p, n in work + [later]]
    config = EngineConfig(scheduler="faulty", num_blocks=64, block_size=4, max_batch_tokens=16)
    plugin = Registers(schedulers={"faulty": bad_schedule(kind)})
    with caplog.at_level(logging.ERROR, logger="jitney"):
        async with Engine(llama, config=config, plugins=[plugin]) as engine:
            results = await run_together(engine, [greedy(p, n) for p, n in work])
            assert engine.healthy
            after = await outcome(engine, greedy(*later))
            assert not leaks(engine)
    failed = [r for r in results if r[0] == "failed"]
    assert failed, "the faulty step's requests fail"
    for _, message in failed:
        assert "scheduler 'faulty' failed" in message
    for (status, tokens), ref in zip(results, refs):
        assert status == "failed" or tokens == ref  # the others' tokens are untouched
    assert after == ("ok", refs[-1])  # a request submitted afterwards runs
    assert any("scheduler 'faulty'" in r.getMessage() for r in caplog.records)


async def test_a_scheduler_whose_on_events_raises_fails_those_requests_only(llama, caplog):
    class Observant(FifoScheduler):
        calls = 0

        def on_events(self, events):
            Observant.calls += 1
            if Observant.calls == 1:
                raise ValueError("bad bookkeeping")

    config = EngineConfig(scheduler="observant", num_blocks=64, block_size=4)
    with caplog.at_level(logging.ERROR, logger="jitney"):
        async with Engine(llama, config=config, plugins=[Registers(schedulers={"observant": Observant})]) as engine:
            first = await outcome(engine, greedy([4, 5, 6], 5))
            second = await outcome(engine, greedy([4, 5, 6, 7], 5))
            assert not leaks(engine)
    assert first[0] == "failed" and "on_events" in first[1] and "bad bookkeeping" in first[1]
    assert second == ("ok", reference(llama, [4, 5, 6, 7], 5))
    assert sum("scheduler 'observant'" in r.getMessage() for r in caplog.records) == 1


# -- 3. observers --------------------------------------------------------------------------------------------


class Counting:
    def __init__(self):
        self.finished = 0

    @hookimpl
    def jitney_on_events(self, events, engine):
        self.finished += sum(isinstance(e, ev.RequestFinished) for e in events)


class Failing:
    @hookimpl
    def jitney_on_events(self, events, engine):
        raise RuntimeError("observer bug")


@pytest.mark.parametrize("order", ["bad first", "bad last"])
async def test_a_failing_observer_does_not_silence_the_others(llama, order, caplog):
    good = Counting()
    plugins = [Failing(), good] if order == "bad first" else [good, Failing()]
    with caplog.at_level(logging.ERROR, logger="jitney"):
        async with Engine(llama, config=EngineConfig(num_blocks=64), plugins=plugins) as engine:
            results = await run_together(engine, [greedy([3 + i, 4, 5], 6) for i in range(5)])
    assert all(status == "ok" for status, _ in results)
    assert good.finished == 5
    assert engine.step_count > 1
    assert sum("observer bug" in r.getMessage() for r in caplog.records) == 1  # once, not every step


async def test_engine_started_raising_leaves_nothing_bound(caplog):
    model = tiny_llama()
    before = model.config._attn_implementation

    class Refuses:
        @hookimpl
        def jitney_engine_started(self, engine):
            raise RuntimeError("not today")

    engine = Engine(model, config=EngineConfig(num_blocks=16), plugins=[Refuses()])
    with pytest.raises(RuntimeError, match="not today"):
        async with engine:
            pass
    assert model.config._attn_implementation == before
    assert not engine.healthy
    assert not [t for t in threading.enumerate() if t.name.startswith("jitney-forward")]
    ref = reference(model, [4, 5, 6], 4)  # the model runs as it did before
    async with Engine(model, config=EngineConfig(num_blocks=16)) as again:
        assert (await again.generate(greedy([4, 5, 6], 4))).token_ids == ref


# -- eviction policies and offload backends -------------------------------------------------------------------


class RaisingPolicy:
    def __init__(self):
        self.calls = 0

    def priority(self, block):
        self.calls += 1
        if self.calls > 3:
            raise ZeroDivisionError("policy bug")
        return block.last_access


class IncomparablePolicy:
    def __init__(self):
        self.calls = 0

    def priority(self, block):
        self.calls += 1
        return None if self.calls % 2 else block.last_access


SHARED = [list(range(3, 23)) + [i, i + 1, i + 2] for i in range(30, 230, 25)]  # 8 prompts, one 20-token prefix


@pytest.mark.parametrize("policy", [RaisingPolicy, IncomparablePolicy])
async def test_a_faulty_eviction_policy_falls_back_without_failing_requests(llama, policy, caplog):
    refs = [reference(llama, p, 8) for p in SHARED]
    config = EngineConfig(eviction="faulty", num_blocks=24, block_size=4, max_batch_tokens=32)
    plugin = Registers(eviction={"faulty": lambda config: policy()})
    with caplog.at_level(logging.ERROR, logger="jitney"):
        async with Engine(llama, config=config, plugins=[plugin]) as engine:
            first = await run_together(engine, [greedy(p, 8) for p in SHARED])
            second = await run_together(engine, [greedy(p, 8) for p in reversed(SHARED)])
            assert not leaks(engine)
            assert engine.cache.blocks_demoted > 0  # the pool had to demote cached blocks
    assert first == [("ok", r) for r in refs]
    assert second == [("ok", r) for r in reversed(refs)]
    assert sum(f"eviction policy {policy.__name__} failed" in r.getMessage() for r in caplog.records) == 1


def faulty_offload(method: str):
    class Faulty(CpuSwapPool):
        pass

    def broken(self, *args, **kwargs):
        raise OSError(f"{method} failed")

    setattr(Faulty, method, broken)
    return lambda config, cache: Faulty(config, cache)


@pytest.mark.parametrize("method", ["store", "load", "free_blocks"])
async def test_a_faulty_offload_backend_costs_recomputation_not_requests(llama, method, caplog):
    work = [([3 + i] * 4 + [50 + i, 60 + i], 30) for i in range(8)]
    refs = [reference(llama, p, n) for p, n in work]
    config = EngineConfig(offload_backend="faulty", cpu_offload_space=0.01, num_blocks=16, block_size=4,
                          safety_margin=0.0, max_batch_tokens=32)
    seen = Counting()

    class Kinds:
        kinds: set[str] = set()

        @hookimpl
        def jitney_on_events(self, events, engine):
            Kinds.kinds.update(type(e).__name__ for e in events)

    plugin = Registers(offload={"faulty": faulty_offload(method)})
    with caplog.at_level(logging.ERROR, logger="jitney"):
        async with Engine(llama, config=config, plugins=[plugin, seen, Kinds()]) as engine:
            results = await run_together(engine, [greedy(p, n) for p, n in work])
            assert not leaks(engine)
    assert results == [("ok", r) for r in refs]
    assert "RequestSoftReset" in Kinds.kinds
    assert sum("offload backend 'faulty'" in r.getMessage() for r in caplog.records) == 1


# -- 4. one client's sampling parameters ---------------------------------------------------------------------


async def test_extreme_sampling_parameters_do_not_poison_the_batch(llama):
    prompts = [[3 + i, 10, 20, 30] for i in range(6)]
    refs = [reference(llama, p, 10) for p in prompts]
    params = [
        SamplingParams(max_new_tokens=10, ignore_eos=True),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1.0, top_p=1e-300, seed=1),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=1e-40, seed=2),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=5e-324, top_k=1, seed=3),
        SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.7, top_p=0.9, top_k=5, seed=4),
        SamplingParams(max_new_tokens=10, ignore_eos=True),
    ]
    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        results = await run_together(engine, [Request(p, sp) for p, sp in zip(prompts, params)])
    assert all(status == "ok" for status, _ in results)
    # a vanishing temperature or top_p keeps only the likeliest token: the greedy one
    assert [r[1] for r in results[:4]] == refs[:4]
    assert results[5][1] == refs[5]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_temperatures_that_are_not_finite_are_refused(value):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=value)


async def test_a_row_whose_sampling_fails_fails_that_request_alone(llama, monkeypatch):
    real = sampling._draw

    def draw(logits, p, gen):
        if p.seed == 666:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, p, gen)

    monkeypatch.setattr(sampling, "_draw", draw)
    prompts = [[3 + i, 10, 20] for i in range(4)]
    refs = [reference(llama, p, 8) for p in prompts]
    reqs = [greedy(p, 8) for p in prompts]
    reqs[2] = Request(prompts[2], SamplingParams(max_new_tokens=8, temperature=1.0, seed=666))
    async with Engine(llama, config=EngineConfig(num_blocks=64)) as engine:
        results = await run_together(engine, reqs)
        assert not leaks(engine)
    assert results[2][0] == "failed" and "sampling failed" in results[2][1]
    assert [results[i] for i in (0, 1, 3)] == [("ok", refs[i]) for i in (0, 1, 3)]


# -- 7. API surprises -----------------------------------------------------------------------------------------


async def test_stop_strings_without_a_tokenizer_are_refused(llama):
    async with Engine(llama, config=EngineConfig(num_blocks=16)) as engine:
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            engine.submit(Request([4, 5], SamplingParams(stop=("x",))))


async def test_a_second_engine_on_the_same_model_is_refused_at_entry():
    model = tiny_llama()
    ref = reference(model, [4, 5, 6], 5)
    async with Engine(model, config=EngineConfig(num_blocks=16)) as first:
        with pytest.raises(RuntimeError, match="already served by a running jitney engine"):
            async with Engine(model, config=EngineConfig(num_blocks=16)):
                pass
        assert first.healthy
        assert (await first.generate(greedy([4, 5, 6], 5))).token_ids == ref
    async with Engine(model, config=EngineConfig(num_blocks=16)) as second:  # free again once the first exits
        assert (await second.generate(greedy([4, 5, 6], 5))).token_ids == ref


async def test_a_request_object_is_not_written_and_can_be_submitted_again(llama):
    req = greedy([4, 5, 6], 6)
    async with Engine(llama, config=EngineConfig(num_blocks=32)) as engine:
        a, b = engine.stream(req), engine.stream(req)  # the same object twice, at once
        assert a.request_id != b.request_id
        outs = [[t.token_id async for t in a], [t.token_id async for t in b]]
    assert req.request_id is None
    assert outs[0] == outs[1] == reference(llama, [4, 5, 6], 6)


async def test_abort_takes_the_ids_that_events_carry_for_samples(llama):
    ids = []

    class Ids:
        @hookimpl
        def jitney_on_events(self, events, engine):
            ids.extend(e.request_id for e in events if isinstance(e, ev.TokensGenerated))

    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=5, n=3, ignore_eos=True)
    async with Engine(llama, config=EngineConfig(num_blocks=64), plugins=[Ids()]) as engine:
        stream = engine.stream(Request([4, 5, 6], params, request_id="r"))
        async for tok in stream:
            if "r#1" in ids:
                assert engine.abort("r#1")
                break
        rest = [t async for t in stream]
        done = stream.completion()
        assert not engine.abort("r#7") and not engine.abort("r#x")
        assert not leaks(engine)
    assert rest
    reasons = {s.index: s.finish_reason for s in done.samples}
    assert reasons == {0: "length", 1: "cancelled", 2: "length"}


async def test_streamed_text_equals_the_completion_text_with_stop_strings(smollm2):
    model, tokenizer = smollm2
    prompts = ["Once upon a time, there was a little", "The capital of France is", "1, 2, 3, 4,"]
    stops = [(" sun", "Emma"), (".", " Paris is"), (" 7", ", 9")]
    async with Engine(model, tokenizer, EngineConfig(num_blocks=64)) as engine:
        for prompt, stop in zip(prompts, stops):
            async with engine.stream(Request(prompt, SamplingParams(max_new_tokens=24, stop=stop))) as stream:
                text = "".join([t.text async for t in stream])
            done = stream.completion()
            assert text == done.text
            assert not any(s in text for s in stop)
