"""Plugins: built-ins arrive through the entry-point group, names are checked, observers see each step once."""

from __future__ import annotations

import anyio
import msgspec
import pluggy
import pytest
from support import random_requests

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core import events as ev
from jitney.core.hooks import hookimpl, make_plugin_manager


def test_builtins_are_loaded_from_the_jitney_entry_point_group():
    pm = make_plugin_manager()
    providers = {dist.project_name for _, dist in pm.list_plugin_distinfo()}
    assert providers == {"jitney"}
    names = {name for name, _ in pm.list_name_plugin()}
    assert {"schedulers", "kernels"} <= names


def test_unknown_scheduler_lists_the_registered_names(llama):
    with pytest.raises(ValueError, match="unknown scheduler 'fifoo'; registered: fair_share, fifo"):
        Engine(llama, config=EngineConfig(scheduler="fifoo", num_blocks=8))
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'; registered: cpu, torch, triton"):
        Engine(llama, config=EngineConfig(attention_backend="cuda", num_blocks=8))


def test_a_misspelled_hook_fails_loudly():
    class Typo:
        @hookimpl
        def jitney_on_event(self, events, engine):  # missing "s"
            pass

    with pytest.raises(pluggy.PluginValidationError, match="jitney_on_event"):
        make_plugin_manager([Typo()])


async def test_observers_get_each_steps_events_in_one_call(llama):
    calls: list[list[ev.Event]] = []

    class Observer:
        @hookimpl
        def jitney_on_events(self, events, engine):
            calls.append(list(events))

    work = random_requests(4, llama.config.vocab_size, max_prompt=30, max_new=6, seed=9)
    async with Engine(llama, config=EngineConfig(max_batch_tokens=16, num_blocks=64), plugins=[Observer()]) as engine:
        async with anyio.create_task_group() as tg:
            for prompt, n in work:
                tg.start_soon(engine.generate, Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    steps = [e for call in calls for e in call if isinstance(e, ev.StepCompleted)]
    assert all(sum(isinstance(e, ev.StepCompleted) for e in call) <= 1 for call in calls)
    assert len(steps) == engine.step_count
    everything = [e for call in calls for e in call]
    finished = [e for e in everything if isinstance(e, ev.RequestFinished)]
    assert sum(isinstance(e, ev.RequestQueued) for e in everything) == len(work)
    assert sorted(e.output_tokens for e in finished) == sorted(n for _, n in work)
    assert sum(e.tokens for e in everything if isinstance(e, ev.TokensGenerated)) == sum(n for _, n in work)
    # Events round-trip through msgpack for traces, tagged by type.
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(everything), type=list[ev.AnyEvent])
    assert decoded == everything


async def test_every_event_carries_its_step_and_every_prefill_chunk_is_published(llama):
    batches: list[list[ev.Event]] = []

    class Observer:
        @hookimpl
        def jitney_on_events(self, events, engine):
            batches.append(list(events))

    work = random_requests(6, llama.config.vocab_size, max_prompt=40, max_new=5, seed=4)
    config = EngineConfig(max_batch_tokens=16, block_size=4, num_blocks=64, speculative_tokens=0)
    async with Engine(llama, config=config, plugins=[Observer()]) as engine:
        async with anyio.create_task_group() as tg:
            for prompt, n in work:
                tg.start_soon(engine.generate, Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    for batch in batches:
        done = [e for e in batch if isinstance(e, ev.StepCompleted)]
        if done:  # a step's events carry its number
            assert {e.step for e in batch} == {done[0].step}
    steps = [e for b in batches for e in b if isinstance(e, ev.StepCompleted)]
    chunks = [e for b in batches for e in b if isinstance(e, ev.PrefillChunk)]
    assert sum(c.tokens for c in chunks) == sum(len(p) for p, _ in work)  # every prompt token, in chunks
    assert [sum(n for _, n in s.batch) for s in steps] == [s.prefill_tokens + s.decode_tokens for s in steps]
    assert not any(c.recompute for c in chunks)  # nothing was reset


async def test_a_prefill_again_after_a_soft_reset_is_marked_as_recomputation(llama):
    seen: list[ev.Event] = []

    class Observer:
        @hookimpl
        def jitney_on_events(self, events, engine):
            seen.extend(events)

    work = random_requests(8, llama.config.vocab_size, max_prompt=20, max_new=30, seed=5)
    config = EngineConfig(max_batch_tokens=32, block_size=4, num_blocks=16, safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[Observer()]) as engine:
        async with anyio.create_task_group() as tg:
            for prompt, n in work:
                tg.start_soon(engine.generate, Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    reset = {e.request_id for e in seen if isinstance(e, ev.RequestSoftReset)}
    again = {e.request_id for e in seen if isinstance(e, ev.PrefillChunk) and e.recompute}
    assert reset and again == reset
