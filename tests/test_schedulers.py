"""The built-in schedulers on constructed states: order, budgets, chunking, the safety margin, preemption."""

from __future__ import annotations

import random

import pytest
import torch

from jitney import EngineConfig, Request, SamplingParams
from jitney.cache.manager import CacheManager
from jitney.core.sequence import Sequence
from jitney.core.request import Priority
from jitney.schedulers.fifo import FifoScheduler, PrefillFirstScheduler
from jitney.schedulers.priority import PriorityScheduler


def seq(prompt_len: int, arrival: int, computed: int = 0, outputs: int = 0, priority: int = 0) -> Sequence:
    request = Request([1] * prompt_len, SamplingParams(max_new_tokens=100), priority=priority)
    s = Sequence(request, [1] * prompt_len, frozenset(), arrival)
    s.output_ids = [2] * outputs
    s.num_computed = computed
    return s


def cache(num_blocks: int = 100) -> CacheManager:
    return CacheManager(1, 1, 4, 4, num_blocks, torch.float32, torch.device("cpu"))


def activate(c: CacheManager, *seqs: Sequence) -> list[Sequence]:
    for s in seqs:
        assert c.reserve(s.request_id, s.num_computed)
    return list(seqs)


def test_decodes_first_then_prefills_then_waiting_in_arrival_order():
    c = cache()
    dec = seq(8, 0, computed=9, outputs=2)  # one token left: a decode
    pre = seq(40, 1, computed=16)  # a chunked prefill in progress
    active = activate(c, dec, pre)
    w1, w2 = seq(10, 2), seq(10, 3)
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100)).schedule([w1, w2], active, c)
    assert [(s.request_id, n) for s, n in batch.entries] == [
        (dec.request_id, 1), (pre.request_id, 24), (w1.request_id, 10), (w2.request_id, 10)]


def test_token_budget_chunks_the_prompt_that_does_not_fit():
    c = cache()
    active = activate(c, seq(8, 0, computed=9, outputs=2))
    batch = FifoScheduler(EngineConfig(max_batch_tokens=16)).schedule([seq(50, 1), seq(5, 2)], active, c)
    assert [n for _, n in batch.entries] == [1, 15]
    assert batch.num_tokens == 16


def chunk_count(k: float, computed: int, n: int) -> float:
    """What a chunk of n tokens after `computed` counts against the token budget at chunk_context_cost k."""
    return n + k * (n * computed + n * (n + 1) / 2)


@pytest.mark.parametrize("computed", [0, 100, 1000])
def test_a_prompt_chunk_counts_its_attention(computed):
    c = cache(num_blocks=400)
    dec = seq(400, 0, computed=409, outputs=10)
    pre = seq(2000, 1, computed=computed)
    active = activate(c, dec, pre)
    k = 0.01
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100, chunk_context_cost=k)).schedule([], active, c)
    (d, one), (p, n) = batch.entries  # the decode counts 1 whatever its context; the chunk is the longest that fits
    assert (d, one, p) == (dec, 1, pre)
    assert chunk_count(k, computed, n) <= 99 < chunk_count(k, computed, n + 1)
    assert n == {0: 72, 100: 44, 1000: 8}[computed]
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100, chunk_context_cost=0.0)).schedule([], active, c)
    assert [n for _, n in batch.entries] == [1, 99]  # 0: tokens only


def test_a_chunk_that_counts_more_than_the_budget_still_moves_alone():
    c = cache(num_blocks=400)
    pre = seq(2000, 1, computed=1000)
    config = EngineConfig(max_batch_tokens=100, chunk_context_cost=1.0)  # a token at 1,000 positions counts 1,001
    batch = FifoScheduler(config).schedule([], activate(c, pre), c)
    assert [(s, n) for s, n in batch.entries] == [(pre, 1)]  # an empty batch takes a token: every step progresses
    dec = seq(8, 0, computed=9, outputs=2)
    batch = FifoScheduler(config).schedule([], activate(c, dec) + [pre], c)
    assert [s for s, _ in batch.entries] == [dec]  # beside a decode, nothing of it fits


def test_a_waiting_prompt_whose_chunk_does_not_fit_gives_its_cached_prefix_back():
    c = CacheManager(1, 1, 4, 4, 100, torch.float32, torch.device("cpu"), prefix_caching=True)
    first = seq(40, 0, computed=40, outputs=1)  # decoding; its 40 prompt tokens cached
    activate(c, first)
    c.commit(first)
    later = seq(80, 1)  # the same 40 tokens first: a prefix hit
    config = EngineConfig(max_batch_tokens=8, chunk_context_cost=1.0)  # its next token counts 42: 7 are left
    batch = FifoScheduler(config).schedule([later], [first], c)
    assert [s for s, _ in batch.entries] == [first]
    assert later.num_computed == 0 and c.blocks_held(later.request_id) == 0  # the match undone, not leaked


def test_request_cap():
    c = cache()
    waiting = [seq(3, i) for i in range(10)]
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100, max_requests_per_batch=4)).schedule(waiting, [], c)
    assert len(batch.entries) == 4


def test_safety_margin_holds_back_new_prefills_while_decodes_go_on():
    c = cache(num_blocks=20)
    dec = seq(60, 0, computed=68, outputs=9)  # holds 17 blocks; 3 free < 0.15 * 20
    active = activate(c, dec)
    batch = FifoScheduler(EngineConfig()).schedule([seq(4, 1)], active, c)
    assert [s.request_id for s, _ in batch.entries] == [dec.request_id]
    batch = FifoScheduler(EngineConfig(safety_margin=0.0)).schedule([seq(4, 1)], active, c)
    assert len(batch.entries) == 2


def test_a_decode_that_cannot_get_a_block_is_reported_stalled():
    c = cache(num_blocks=2)
    full = seq(8, 0, computed=8, outputs=1)  # 8 tokens in 2 blocks, the 9th needs a third
    active = activate(c, full)
    batch = FifoScheduler(EngineConfig()).schedule([], active, c)
    assert batch.entries == [] and batch.stalled == [(full, 1)]


def test_waiting_requests_do_not_overtake_the_head_of_the_queue():
    c = cache(num_blocks=10)
    big, small = seq(60, 0), seq(4, 1)  # big needs 15 blocks
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100, safety_margin=0.0)).schedule([big, small], [], c)
    assert batch.entries == []


def test_prefill_first_finishes_chunked_prompts_before_decodes():
    c = cache()
    dec = seq(8, 0, computed=9, outputs=2)
    pre = seq(40, 1, computed=16)
    active = activate(c, dec, pre)
    batch = PrefillFirstScheduler(EngineConfig(max_batch_tokens=24)).schedule([seq(5, 2)], active, c)
    assert [(s.request_id, n) for s, n in batch.entries] == [(pre.request_id, 24)]
    batch = PrefillFirstScheduler(EngineConfig(max_batch_tokens=100)).schedule([], [dec, pre], c)
    assert [s.request_id for s, _ in batch.entries] == [pre.request_id, dec.request_id]
    assert PrefillFirstScheduler(EngineConfig()).safety_margin == 0.0


def test_cache_budget_bounds_the_blocks_read_in_one_pass():
    c = cache()
    active = activate(c, *[seq(30, i, computed=31, outputs=2) for i in range(5)])  # each reads 8 blocks
    batch = FifoScheduler(EngineConfig(max_batch_cache_blocks=20)).schedule([], active, c)
    assert len(batch.entries) == 2


@pytest.mark.parametrize("make", [FifoScheduler, PrefillFirstScheduler, PriorityScheduler])
def test_no_budget_is_ever_exceeded(make):
    rng = random.Random(0)
    for trial in range(50):
        c = cache(num_blocks=rng.randint(20, 200))
        config = EngineConfig(max_batch_tokens=rng.randint(1, 64), max_requests_per_batch=rng.randint(1, 8),
                              max_batch_cache_blocks=rng.randint(5, 100), chunk_context_cost=rng.choice([0, 0.01, 0.5]))
        active = []
        for i in range(rng.randint(0, 6)):
            s = seq(rng.randint(1, 40), i, priority=rng.choice([0, 10]))
            s.num_computed = rng.randint(0, s.num_tokens - 1)
            if c.reserve(s.request_id, s.num_computed):
                active.append(s)
        waiting = [seq(rng.randint(1, 80), 10 + i, priority=rng.choice([0, 10])) for i in range(rng.randint(0, 6))]
        batch = make(config).schedule(waiting, active, c)
        assert batch.num_tokens <= config.max_batch_tokens
        assert len(batch.entries) <= config.max_requests_per_batch
        reads = sum(-(-(s.num_computed + n) // 4) for s, n in batch.entries)
        assert len(batch.entries) <= 1 or reads <= config.max_batch_cache_blocks
        for s, n in batch.entries:
            assert 1 <= n <= s.remaining
            assert c.blocks_needed(s.request_id, s.num_computed + n) == 0  # its cache is reserved


def test_priority_serves_interactive_first():
    c = cache()
    bg = seq(8, 0, computed=9, outputs=2, priority=Priority.BACKGROUND)
    active = activate(c, bg)
    fg = seq(30, 1, priority=Priority.INTERACTIVE)
    batch = PriorityScheduler(EngineConfig(max_batch_tokens=30)).schedule([fg], active, c)
    assert [(s.request_id, n) for s, n in batch.entries] == [(fg.request_id, 30)]
    batch = PriorityScheduler(EngineConfig(max_batch_tokens=31)).schedule([fg], active, c)
    assert [s.request_id for s, _ in batch.entries] == [fg.request_id, bg.request_id]


def test_priority_preempts_the_newest_background_work_when_the_cache_is_short():
    c = cache(num_blocks=20)
    old_bg = seq(28, 0, computed=29, outputs=2, priority=Priority.BACKGROUND)  # 8 blocks
    new_bg = seq(28, 1, computed=29, outputs=2, priority=Priority.BACKGROUND)  # 8 blocks
    active = activate(c, old_bg, new_bg)
    fg = seq(24, 2, priority=Priority.INTERACTIVE)  # needs 6 blocks, 4 are free
    batch = PriorityScheduler(EngineConfig(safety_margin=0.0)).schedule([fg], active, c)
    assert batch.preempt == [new_bg] and batch.entries == []
    # an interactive request never preempts another interactive one
    fg_active = [seq(28, 0, computed=29, outputs=2), seq(28, 1, computed=29, outputs=2)]
    c2 = cache(num_blocks=20)
    batch = PriorityScheduler(EngineConfig(safety_margin=0.0)).schedule([seq(24, 2)], activate(c2, *fg_active), c2)
    assert batch.preempt == []


async def test_a_scheduler_may_observe_lifecycle_events(llama):
    from jitney import Engine

    class Watching(FifoScheduler):
        seen: list = []

        def on_events(self, events):
            self.seen.extend(type(e).__name__ for e in events)

    async with Engine(llama, config=EngineConfig(num_blocks=32)) as engine:
        engine.scheduler = Watching(engine.config)
        await engine.generate(Request([1, 2, 3], SamplingParams(max_new_tokens=3)))
    assert {"RequestQueued", "FirstToken", "RequestFinished", "StepCompleted"} <= set(Watching.seen)


def test_decodes_then_prefills_is_the_two_helpers_in_one_pass():
    from jitney.schedulers.base import decodes, decodes_then_prefills, prefills

    rng = random.Random(4)
    active = [seq(30, i, computed=rng.choice([0, 12, 29, 30, 30, 31]), outputs=1) for i in range(40)]  # 31 tokens each
    assert decodes_then_prefills(active) == decodes(active) + prefills(active)
    assert 0 < len(decodes(active)) < len(prefills(active)) + len(decodes(active)) < len(active)  # all three kinds


@pytest.mark.parametrize("tokens, requests", [(10_000, 256), (25, 256), (10_000, 9)])
def test_one_pass_batch_is_the_batch_of_decodes_then_prefills(tokens, requests):
    from jitney.schedulers.base import BatchBuilder, decodes_then_prefills

    rng = random.Random(5)
    active = []
    for i in range(40):  # decodes within a block and at a block's first slot (4 here), prefills, one done
        outputs = rng.choice([1, 3])
        total = 30 + outputs
        active.append(seq(30, i, computed=rng.choice([0, 12, total - 2, total - 1, total - 1, total]), outputs=outputs))
    assert {s.num_computed % 4 for s in active if s.remaining == 1} == {0, 2}
    config = EngineConfig(max_batch_tokens=tokens, max_requests_per_batch=requests)
    built = []
    for one_pass in (True, False):
        c = cache(num_blocks=400)
        activate(c, *active)
        b = BatchBuilder(config, c, 0.0)
        b.add_decodes_then_prefills(active) if one_pass else b.add_active(decodes_then_prefills(active))
        built.append(([(s.request_id, n) for s, n in b.batch.entries], b.tokens_left, b.requests_left))
    assert built[0] == built[1]
    entries, tokens_left, requests_left = built[0]
    if (tokens, requests) == (10_000, 256):  # nothing limits: every decode, then every prefill
        assert {n > 1 for _, n in entries} == {True, False}
    else:  # a budget ran out part-way
        assert tokens_left == 0 or requests_left == 0
