"""Prompt-lookup speculation: guesses read from a request's own earlier tokens, checked by the model in the
step that computes its next token; every request gets the tokens it gets without (and that `generate` gives)."""

from __future__ import annotations

import anyio
import pytest
from support import random_requests, reference, tiny_llama, tiny_qwen2
from test_speculative import Steps, generate_all, greedy

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.core import lookup
from jitney.core.lookup import NgramIndex
from jitney.core.request import Request as _Request
from jitney.core.sequence import Sequence


def sequence(tokens: list[int]) -> Sequence:
    return Sequence(_Request(tokens, SamplingParams(max_new_tokens=8)), list(tokens), frozenset(), arrival=0)


def test_a_guess_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens():
    seq = sequence([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3])
    assert NgramIndex().propose(seq, 4) == [7, 5, 1, 2]  # the later of the two occurrences of 1 2 3
    assert NgramIndex().propose(seq, 1) == [7]
    assert NgramIndex().propose(seq, 0) == []


def test_the_longer_run_is_looked_up_first_then_the_shorter():
    assert NgramIndex().propose(sequence([4, 2, 3, 8, 5, 2, 3, 6, 4, 2, 3]), 2) == [8, 5]  # 4 2 3 before 2 3
    assert NgramIndex().propose(sequence([4, 2, 3, 8, 5, 2, 3, 6, 7, 2, 3]), 2) == [6, 7]  # only 2 3 occurred
    assert NgramIndex().propose(sequence([1, 2, 3, 4, 5, 6]), 4) == []  # nothing repeats
    assert NgramIndex().propose(sequence([5, 5]), 4) == []  # too short to hold a run and its follower


def test_tokens_repeating_with_a_short_period_are_guessed_to_go_on_repeating():
    assert NgramIndex().propose(sequence([9, 1, 2, 1, 2]), 4) == [1, 2, 1, 2]  # 1 2 last occurred two tokens back
    assert NgramIndex().propose(sequence([5, 6, 7, 7, 7]), 3) == [7, 7, 7]
    assert NgramIndex().propose(sequence([3, 8, 4, 6, 8, 4]), 5) == [6, 8, 4, 6, 8]


def test_the_index_follows_tokens_added_after_it_was_made():
    seq, index = sequence([1, 2, 3, 4]), NgramIndex()
    assert index.propose(seq, 4) == []
    seq.output_ids += [5, 6, 2, 3]
    assert index.propose(seq, 4) == [4, 5, 6, 2]
    seq.output_ids += [4, 5, 1, 2]
    assert index.propose(seq, 2) == [3, 4]


def test_after_a_guess_the_next_one_is_at_most_one_longer_than_what_was_right():
    seq, index = sequence([1, 2, 3, 4, 5, 6, 7, 1, 2, 3]), NgramIndex()
    index.reach = 2  # (as `lookup.learn` leaves it after a guess with one token right)
    assert index.propose(seq, 4) == [4, 5]


@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("max_batch_tokens", [16, 256])
async def test_lookup_steps_give_generates_tokens(make, max_batch_tokens):
    # Repeating prompts (the tiny random models then repeat too): guesses are made, taken and refused. The draft
    # off, so that every decode step of these few requests may guess; 16 tokens a step also chunks the prompts.
    model = make()
    work = [([7, 8, 9, 10, 11] * 6, 40), ([40, 41, 42] * 5 + [43], 30), ([100 + i for i in range(20)] * 2, 35)]
    work += random_requests(5, model.config.vocab_size, max_new=40, seed=3)
    refs = [reference(model, p, n) for p, n in work]
    steps = Steps()
    config = EngineConfig(speculative_tokens=0, lookup_tokens=4, block_size=4, num_blocks=300,
                          max_batch_tokens=max_batch_tokens)
    async with Engine(model, config=config, plugins=[steps]) as engine:
        assert engine.lookup == 4
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
        assert engine.num_free_blocks == 300
    guessed = [s for s in steps.steps if s.draft_tokens]
    assert guessed and sum(s.accepted_tokens for s in guessed) > 0
    assert all(s.requests + s.draft_tokens <= max_batch_tokens and s.draft_tokens <= 4 * s.requests for s in guessed)


def injected(refs: dict[tuple[int, ...], list[int]], wrong: bool):
    """Stands in for `lookup.guesses`: each request's next tokens as `generate` gives them (`refs`, by prompt), or
    those tokens each made wrong; every third request none. Reserves their cache as `lookup.guesses` does."""

    def guesses(entries, k, max_tokens, cache):
        out = []
        for i, (seq, _) in enumerate(entries):
            if seq.status.value != "decoding" or not seq.params.greedy:
                return None
            t, ref = len(seq.output_ids), refs[tuple(seq.prompt_ids)]
            guess = [] if i % 3 == 2 else ref[t : t + min(k, seq.max_new_tokens - t - 1)]
            guess = [(x + 1) % 256 for x in guess] if wrong else guess
            out.append(guess if cache.reserve(seq.request_id, seq.num_tokens + len(guess)) else [])
        return out

    return guesses


@pytest.mark.parametrize("wrong", [False, True], ids=["right", "wrong"])
async def test_every_guess_right_or_every_guess_wrong_gives_generates_tokens(llama, monkeypatch, wrong):
    work = random_requests(6, llama.config.vocab_size, max_new=30, seed=5)
    refs = {tuple(p): reference(llama, p, n) for p, n in work}
    monkeypatch.setattr(lookup, "guesses", injected(refs, wrong))
    steps = Steps()
    config = EngineConfig(speculative_tokens=0, lookup_tokens=3, block_size=4, num_blocks=200)
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == [refs[tuple(p)] for p, _ in work]
        assert engine.num_free_blocks == 200
    guessed = [s for s in steps.steps if s.draft_tokens]
    assert guessed
    if wrong:  # each wrong guess's row was computed and thrown away
        assert all(s.accepted_tokens == 0 for s in guessed)
    else:
        assert all(s.accepted_tokens == s.draft_tokens for s in guessed)


async def test_lookup_takes_the_steps_the_draft_does_not(llama):
    # more rows than speculative_max_rows: the draft stays out, prompt lookup guesses
    work = [([7, 8, 9, 10, 11] * 4 + [200 + i], 24) for i in range(12)]
    refs = [reference(llama, p, n) for p, n in work]
    steps = Steps()
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=400), plugins=[steps]) as engine:
        assert (engine.speculate, engine.lookup) == (8, 4)  # (the defaults)
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
    assert any(s.draft_tokens and s.requests > 5 for s in steps.steps)


async def test_a_guess_never_passes_the_last_token_or_a_stop_token(llama):
    prompt = [7, 8, 9, 10, 11] * 6
    ref = reference(llama, prompt, 40)
    stop = ref[9]
    config = EngineConfig(speculative_tokens=0, lookup_tokens=4, block_size=4)
    for n, stops in ((13, ()), (40, (stop,))):
        steps = Steps()
        async with Engine(llama, config=config, plugins=[steps]) as engine:
            done = await engine.generate(greedy(prompt, n, stop_token_ids=stops))
            assert engine.num_free_blocks == engine.cache.num_blocks
        assert steps.drafted > 0  # it guessed on the way
        end = ref.index(stop) + 1 if stops else n
        assert done.token_ids == ref[:end] and done.finish_reason == ("stop" if stops else "length")


async def test_a_nearly_full_cache_with_preemptions_keeps_the_tokens_the_same(llama):
    # a cache the requests barely fit in: they guess and are preempted (a guess may find no block)
    work = [([7, 8, 9, 10, 11] * 4 + [200 + i], 30) for i in range(6)]
    refs = [reference(llama, p, n) for p, n in work]
    steps = Steps()
    config = EngineConfig(speculative_tokens=0, lookup_tokens=4, block_size=4, num_blocks=40, safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        assert await generate_all(engine, [greedy(p, n) for p, n in work]) == refs
        assert engine.num_free_blocks == 40
    assert any(s.draft_tokens for s in steps.steps) and any(s.preemptions for s in steps.steps)


async def test_sampled_requests_take_no_guesses_and_greedy_ones_beside_them_neither(llama):
    prompt = [7, 8, 9, 10, 11] * 6
    steps = Steps()
    config = EngineConfig(speculative_tokens=0, lookup_tokens=4, block_size=4)
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        sampled = Request(prompt, SamplingParams(max_new_tokens=30, temperature=0.8, seed=1))
        await generate_all(engine, [sampled, greedy(prompt, 30)])
    together = [s for s in steps.steps if s.requests == 2]
    assert together and all(s.draft_tokens == 0 for s in together)


async def test_leaving_a_stream_during_lookup_steps_frees_its_blocks(llama):
    prompt = [7, 8, 9, 10, 11] * 6
    config = EngineConfig(speculative_tokens=0, lookup_tokens=4, block_size=4, num_blocks=100)
    steps = Steps()
    async with Engine(llama, config=config, plugins=[steps]) as engine:
        others = [greedy(prompt, 40) for _ in range(3)]
        async with anyio.create_task_group() as tg:
            for req in others:
                tg.start_soon(engine.generate, req)
            seen = 0
            async with engine.stream(greedy(prompt, 60)) as stream:
                async for _ in stream:
                    seen += 1
                    if seen == 10:
                        break
        assert engine.num_free_blocks == 100
    assert steps.drafted > 0


async def test_lookup_off_makes_no_guesses(llama):
    steps = Steps()
    async with Engine(llama, config=EngineConfig(lookup_tokens=0, speculative_tokens=0), plugins=[steps]) as engine:
        assert engine.lookup == 0
        await engine.generate(greedy([7, 8, 9, 10, 11] * 6, 30))
    assert not any(s.draft_tokens for s in steps.steps)


def test_a_negative_lookup_tokens_is_refused_by_name():
    with pytest.raises(ValueError, match="lookup_tokens"):
        EngineConfig(lookup_tokens=-1)
