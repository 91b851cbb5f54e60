"""The FIFO scheduler on constructed states: order, budgets, chunking, the safety margin, the request cap."""

from __future__ import annotations

import torch

from jitney import EngineConfig, Request, SamplingParams
from jitney.cache import CacheManager
from jitney.core.sequence import Sequence
from jitney.schedulers import FifoScheduler


def seq(prompt_len: int, arrival: int, computed: int = 0, outputs: int = 0) -> Sequence:
    s = Sequence(Request([1] * prompt_len, SamplingParams(max_new_tokens=100)), [1] * prompt_len, frozenset(), arrival)
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
    assert batch.entries == [] and batch.stalled == [full]


def test_waiting_requests_do_not_overtake_the_head_of_the_queue():
    c = cache(num_blocks=10)
    big, small = seq(60, 0), seq(4, 1)  # big needs 15 blocks
    batch = FifoScheduler(EngineConfig(max_batch_tokens=100, safety_margin=0.0)).schedule([big, small], [], c)
    assert batch.entries == []
