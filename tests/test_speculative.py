"""Speculative decoding in the CPU's one-call decode steps: an int8 draft proposes, the model checks, and every
request gets the tokens it gets without (and that `generate` gives)."""

from __future__ import annotations

import logging

import anyio
import pytest
import torch
from support import random_requests, reference, tiny_gemma3, tiny_llama, tiny_mistral, tiny_qwen2

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core import events as ev
from jitney.core.hooks import hookimpl
from jitney.kernels import cpu_linear, native


class Steps:
    def __init__(self):
        self.steps: list[ev.StepCompleted] = []
        self.prefills: list[ev.PrefillStarted] = []

    @hookimpl
    def jitney_on_events(self, events, engine):
        self.steps += [e for e in events if isinstance(e, ev.StepCompleted)]
        self.prefills += [e for e in events if isinstance(e, ev.PrefillStarted)]

    @property
    def drafted(self) -> int:
        return sum(s.draft_tokens for s in self.steps)


async def generate_all(engine: Engine, requests: list[Request]) -> list[list[int]]:
    out: dict[int, list[int]] = {}

    async def one(i: int, req: Request) -> None:
        out[i] = (await engine.generate(req)).token_ids

    async with anyio.create_task_group() as tg:
        for i, req in enumerate(requests):
            tg.start_soon(one, i, req)
    return [out[i] for i in range(len(requests))]


def greedy(prompt, n, **kw):
    return Request(prompt, SamplingParams(max_new_tokens=n, **kw))


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2, lambda: tiny_gemma3(layer_types=["full_attention"] * 3)],
                         ids=["llama", "qwen2", "gemma3"])  # (Gemma3 without its sliding layers, which turn speculation off)
@pytest.mark.parametrize("count", [1, 2, 3, 6])
async def test_speculative_steps_give_generates_tokens(make, count):
    # up to 5 requests: 4 proposals a step, fewer where the rows would pass 16; 6: none until one has ended (at
    # least 2 proposals each); prompt lookup off: the draft's steps alone
    model = make()
    work = random_requests(count, model.config.vocab_size, max_new=40, seed=count)
    refs = [reference(model, p, n) for p, n in work]
    steps = Steps()
    config = EngineConfig(speculative_tokens=4, lookup_tokens=0, block_size=4, num_blocks=200)
    async with Engine(model, config=config, plugins=[steps]) as engine:
        assert engine.speculate == 4
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
        assert engine.num_free_blocks == 200
    rows = config.speculative_max_rows
    assert steps.drafted > 0
    assert all(0 <= s.accepted_tokens <= s.draft_tokens <= rows - s.requests for s in steps.steps)
    assert all(s.draft_tokens == 0 for s in steps.steps if s.requests > rows // 3)


@pytest.mark.parametrize("count", [1, 2])
async def test_by_default_a_request_decoding_alone_gets_eight_proposals_a_step(count):
    # (speculative_max_rows caps them by the rows: 7 each for two requests)
    model = tiny_llama()
    work = [(prompt, 40) for prompt, _ in random_requests(count, model.config.vocab_size, seed=10 + count)]
    refs = [reference(model, p, n) for p, n in work]
    steps = Steps()
    async with Engine(model, config=EngineConfig(lookup_tokens=0, block_size=4, num_blocks=200), plugins=[steps]) as engine:
        assert engine.speculate == 8
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
    most = {1: 8, 2: 14}[count]
    assert max(s.draft_tokens for s in steps.steps if s.requests == count) == most


async def test_a_stop_token_inside_an_accepted_run_ends_the_request_there(llama):
    prompt = list(range(5, 25))
    ref = reference(llama, prompt, 40)
    stop = ref[6]
    first = ref.index(stop)
    config = EngineConfig(speculative_tokens=4, block_size=4)
    async with Engine(llama, config=config) as engine:
        done = await engine.generate(greedy(prompt, 40, stop_token_ids=(stop,)))
    assert done.token_ids == ref[: first + 1]
    assert done.finish_reason == "stop"


async def test_blocks_completed_in_speculative_steps_serve_later_prefixes(llama):
    # the second prompt is the first request's prompt and output: its blocks, hashed as speculative steps
    # completed them, must hold those tokens' keys and values
    prompt = list(range(7, 30))
    steps = Steps()
    async with Engine(llama, config=EngineConfig(speculative_tokens=4, block_size=4), plugins=[steps]) as engine:
        first = (await engine.generate(greedy(prompt, 30))).token_ids
        longer = prompt + first
        second = (await engine.generate(greedy(longer, 20))).token_ids
    assert first == reference(llama, prompt, 30)
    assert second == reference(llama, longer, 20)
    assert steps.prefills[1].cached_tokens == (len(longer) - 1) // 4 * 4  # all but the token left to compute
    assert steps.drafted > 0


async def test_sampled_requests_and_large_batches_do_not_speculate(llama):
    steps = Steps()  # (the draft's rule; prompt lookup, off here, may take large batches: tests/test_lookup.py)
    async with Engine(llama, config=EngineConfig(speculative_tokens=4, lookup_tokens=0), plugins=[steps]) as engine:
        sampled = [Request(list(range(3, 12)), SamplingParams(max_new_tokens=12, temperature=0.8, seed=i)) for i in range(2)]
        await generate_all(engine, sampled)
        assert steps.drafted == 0
        await generate_all(engine, [greedy(list(range(3 + i, 12)), 12) for i in range(6)])  # 6 rows x (1 + 2) > 16
        assert steps.drafted == 0


async def test_speculation_is_off_where_the_one_call_decoder_is_not(caplog):
    model = tiny_mistral(window=8)  # sliding-window layers
    work = random_requests(2, model.config.vocab_size, max_prompt=20, max_new=16, seed=2)
    refs = [reference(model, p, n) for p, n in work]
    with caplog.at_level(logging.WARNING, logger="jitney"):
        async with Engine(model, config=EngineConfig(speculative_tokens=3, block_size=4)) as engine:
            assert engine.speculate == 0
            assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
    assert "speculative_tokens=3" in caplog.text


def test_int8_panels_match_the_rounded_weights():
    kernels = native.load()
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 70, generator=g), torch.randn(300, generator=g)
    w[7] = 0  # (an all-zero feature: scale 1)
    scale = w.abs().amax(1, keepdim=True) / 127
    rounded = (w / torch.where(scale > 0, scale, 1)).round().clamp(-127, 127) * torch.where(scale > 0, scale, 1)
    assert torch.equal(cpu_linear.int8_rounded(w), rounded)
    packed = cpu_linear.pack_int8([w[:100], w[100:]])
    assert packed.dtype == torch.int8 and packed.shape == (19, 70 * 16 + 64)
    for rows in (1, 2, 5, 9, 13, 40):
        x = torch.randn(rows, 70, generator=g)
        torch.testing.assert_close(kernels.panel_linear(x, packed, 300, b), x @ rounded.T + b, atol=1e-5, rtol=1e-5)
    # up to 48 rows go through tiles of up to six rows, more widen the weights once for all of them; each row's
    # outputs are the same whatever the rows computed with it
    x = torch.randn(60, 70, generator=g)
    alone = torch.cat([kernels.panel_linear(x[i : i + 1].contiguous(), packed, 300, b) for i in range(60)])
    for rows in (2, 3, 7, 12, 13, 48, 49, 60):
        assert torch.equal(kernels.panel_linear(x[:rows].contiguous(), packed, 300, b), alone[:rows])
    with pytest.raises(RuntimeError, match="one fp32 scale per output feature"):
        kernels.pack_panels_int8([torch.zeros(4, 8, dtype=torch.int8)], torch.ones(3))
    with pytest.raises(RuntimeError, match="int8 weights"):
        kernels.pack_panels_int8([torch.zeros(4, 8)], torch.ones(4))


async def test_speculation_and_async_batching_together(llama):
    # by default async batching turns speculation off; both asked for, speculative steps are simply not chained
    # (here eight requests decode in chained plain steps, the last few speculate)
    work = random_requests(8, llama.config.vocab_size, max_prompt=10, max_new=30, seed=8)
    refs = [reference(llama, p, n) for p, n in work]
    steps = Steps()
    async with Engine(llama, config=EngineConfig(block_size=4, use_async_batching=True)) as engine:
        assert engine.speculate == 0
    config = EngineConfig(block_size=4, use_async_batching=True, speculative_tokens=2)
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
    assert steps.drafted > 0 and any(s.ahead for s in steps.steps)


async def test_one_proposal_a_step_when_asked_for(llama):
    # by default a step speculates only with two proposals or more a request; asked for one, it gets one
    prompt = list(range(4, 20))
    ref = reference(llama, prompt, 20)
    steps = Steps()
    async with Engine(llama, config=EngineConfig(speculative_tokens=1, block_size=4), plugins=[steps]) as engine:
        assert (await engine.generate(greedy(prompt, 20))).token_ids == ref
    assert steps.drafted > 0 and all(s.draft_tokens <= 1 for s in steps.steps)


@pytest.mark.parametrize("offload", [0.0, 0.01])
async def test_speculation_under_a_cache_too_small_for_both_requests(llama, offload):
    # 2 x 6 blocks at most, 9 in the cache: proposals' slots run out, one request is offloaded or soft reset
    work = [(list(range(10 + i, 18 + i)), 16) for i in range(2)]
    refs = [reference(llama, p, n) for p, n in work]
    steps = Steps()
    config = EngineConfig(block_size=4, num_blocks=9, cpu_offload_space=offload, speculative_tokens=4)
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
        assert engine.num_free_blocks == 9
    assert steps.drafted > 0 and sum(s.preemptions for s in steps.steps) > 0
