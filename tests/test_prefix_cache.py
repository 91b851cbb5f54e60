"""Prefix caching: the pool's invariants under random operations, exact hits, same tokens on and off."""

from __future__ import annotations

import anyio
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import reference

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.cache.manager import CacheManager
from jitney.cache.eviction import FirstInFirstOut, LeastFrequentlyUsed, LeastRecentlyUsed, MostRecentFirst
from jitney.core import events as ev
from jitney.core.hooks import hookimpl
from jitney.core.sequence import Sequence

BS = 2


def new_seq(tokens: list[int], arrival: int) -> Sequence:
    return Sequence(Request(list(tokens), SamplingParams(max_new_tokens=50)), list(tokens), frozenset(), arrival)


class PoolMachine(RuleBasedStateMachine):
    """Drives admit / grow / fork / free in random order; demotion happens whenever the free blocks run out."""

    @initialize(policy=st.sampled_from([MostRecentFirst, LeastRecentlyUsed, LeastFrequentlyUsed, FirstInFirstOut]))
    def start(self, policy):
        self.cache = CacheManager(1, 1, 2, BS, 12, torch.float32, torch.device("cpu"), prefix_caching=True,
                                  eviction=policy())
        self.seqs: list[Sequence] = []
        self.content: dict[int, tuple[int, ...]] = {}  # block -> the whole prefix its full content ends
        self.arrivals = 0

    def compute(self, seq: Sequence, upto: int) -> None:
        """Pretend the model ran: record what each newly completed block now holds, then hash it."""
        table = self.cache.block_table(seq.request_id, 0)
        tokens = seq.tokens(0, upto)
        for i in range(seq.num_computed // BS, upto // BS):
            self.content[table[i]] = tuple(tokens[: (i + 1) * BS])
        seq.num_computed = upto
        self.cache.commit(seq)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def admit(self, tokens):
        seq = new_seq(tokens, self.arrivals)
        self.arrivals += 1
        hit = self.cache.match_prefix(seq)
        table = self.cache.block_table(seq.request_id, 0) if hit else []
        for i, block in enumerate(table):  # a hit must hold exactly this prefix
            assert self.content[block] == tuple(tokens[: (i + 1) * BS])
        assert hit < len(tokens)
        if self.cache.reserve(seq.request_id, seq.num_tokens):
            self.compute(seq, seq.num_tokens)
            self.seqs.append(seq)
        else:
            self.cache.release(seq.request_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), token=st.integers(0, 2))
    def grow(self, data, token):
        seq = data.draw(st.sampled_from(self.seqs))
        seq.output_ids.append(token)
        if self.cache.reserve(seq.request_id, seq.num_tokens):
            self.compute(seq, seq.num_tokens)
        else:
            seq.output_ids.pop()

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs))
        child = new_seq(parent.prompt_ids, self.arrivals)
        child.output_ids = list(parent.output_ids)
        self.arrivals += 1
        if self.cache.fork(parent.request_id, child.request_id, parent.num_computed):
            child.num_computed = parent.num_computed
            self.seqs.append(child)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.seqs))
        self.seqs.remove(seq)
        self.cache.release(seq.request_id)

    @invariant()
    def books_balance(self):
        pool = self.cache.pools[0]
        owners: dict[int, int] = {}
        for seq in self.seqs:
            table = self.cache.block_table(seq.request_id, 0)
            assert len(set(table)) == len(table)  # no block twice in one table
            for block in table:
                owners[block] = owners.get(block, 0) + 1
        used = {b.id for b in pool.blocks if b.ref_count}
        assert {b: pool.blocks[b].ref_count for b in used} == owners  # reference counts equal owners
        free, cached = set(pool._free), pool._cached
        assert not (free & cached) and not (free & used) and not (cached & used)
        assert len(free) + len(used) + len(cached) == pool.num_blocks == len(pool._free) + len(used) + len(cached)
        hashed = {b.id: b.hash for b in pool.blocks if b.hash is not None}
        assert {v: k for k, v in hashed.items()} == pool.index  # hashes unique among initialized blocks
        assert cached <= set(hashed) and not (free & set(hashed))


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_policies_pick_their_victims():
    class B:
        def __init__(self, created, last_access, hits):
            self.created, self.last_access, self.hits = created, last_access, hits

    blocks = [B(1, 9, 5), B(2, 3, 0), B(3, 7, 0)]
    pick = lambda policy: blocks.index(min(blocks, key=policy.priority))  # noqa: E731
    assert pick(MostRecentFirst()) == 0
    assert pick(LeastRecentlyUsed()) == 1
    assert pick(LeastFrequentlyUsed()) == 1
    assert pick(FirstInFirstOut()) == 0


class Stats:
    def __init__(self):
        self.started: dict[str, int] = {}
        self.steps: list[ev.StepCompleted] = []

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            if isinstance(e, ev.PrefillStarted):
                self.started[e.request_id] = e.cached_tokens
            elif isinstance(e, ev.StepCompleted):
                self.steps.append(e)


def greedy(prompt, n):
    return Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True))


async def test_hits_are_exact_and_tokens_match_with_and_without_sharing(llama):
    system = list(range(10, 26))  # 16 tokens: 4 blocks of 4
    prompts = [system + [40 + i] * (3 + i) for i in range(5)]
    refs = [reference(llama, p, 6) for p in prompts]
    outs = {}
    for sharing in (True, False):
        stats = Stats()
        config = EngineConfig(block_size=4, num_blocks=64, allow_block_sharing=sharing)
        async with Engine(llama, config=config, plugins=[stats]) as engine:
            first = await engine.generate(greedy(prompts[0], 6))
            rest = []
            async with anyio.create_task_group() as tg:
                for p in prompts[1:]:
                    tg.start_soon(lambda p=p: _append(rest, engine.generate(greedy(p, 6))))
            outs[sharing] = [first] + sorted(rest, key=lambda c: len(c.prompt_token_ids))
        hits = [stats.started[c.request_id] for c in outs[sharing]]
        assert hits == ([0, 16, 16, 16, 16] if sharing else [0] * 5)
        assert sum(s.prefix_hit_tokens for s in stats.steps) == sum(hits)
        assert sum(s.prefix_query_tokens for s in stats.steps) == sum(len(p) for p in prompts)
    assert [c.token_ids for c in outs[True]] == [c.token_ids for c in outs[False]] == refs


async def _append(out, coro):
    out.append(await coro)


async def test_a_whole_cached_prompt_still_computes_its_last_token(llama):
    prompt = list(range(30, 46))  # exactly 4 blocks
    stats = Stats()
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=32), plugins=[stats]) as engine:
        a = await engine.generate(greedy(prompt, 5))
        b = await engine.generate(greedy(prompt, 5))
    assert stats.started[b.request_id] == 12
    assert a.token_ids == b.token_ids == reference(llama, prompt, 5)


@pytest.mark.parametrize("eviction", ["mru", "lru", "lfu", "fifo"])
async def test_a_prefix_demoted_while_its_request_waited_is_recomputed_correctly(llama, eviction):
    shared = list(range(50, 66))
    later = shared + [7, 8, 9]
    others = [[100 + i] * 30 for i in range(3)]
    refs = [reference(llama, later, 8)] + [reference(llama, p, 20) for p in others]
    stats = Stats()
    # 14 blocks of 4: the three 50-token requests fill the cache and push the shared prefix out.
    config = EngineConfig(block_size=4, num_blocks=14, eviction=eviction, safety_margin=0.0, max_batch_tokens=64)
    async with Engine(llama, config=config, plugins=[stats]) as engine:
        await engine.generate(greedy(shared, 1))  # leaves 4 cached blocks of `shared`
        results = {}

        async def run(key, req):
            results[key] = await engine.generate(req)

        async with anyio.create_task_group() as tg:
            for i, p in enumerate(others):
                tg.start_soon(run, i, greedy(p, 20))
            await anyio.sleep(0)
            tg.start_soon(run, "later", greedy(later, 8))
    assert sum(s.blocks_demoted for s in stats.steps) > 0
    assert stats.started[results["later"].request_id] < 16  # part of its cached prefix was gone
    assert [results["later"].token_ids] + [results[i].token_ids for i in range(3)] == refs


async def test_parallel_samples_share_the_prompt_and_copy_its_partial_block(llama):
    prompt = list(range(60, 70))  # 2 full blocks of 4 and a partial one
    ref = reference(llama, prompt, 12)
    # (no speculation: its proposals' slots would count among the blocks held below)
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=40, speculative_tokens=0)) as engine:
        start = engine.num_free_blocks
        stream = engine.stream(Request(prompt, SamplingParams(max_new_tokens=12, n=3)))
        seen = {}
        async for tok in stream:
            seen.setdefault(tok.index, []).append(tok.token_id)
            if len(seen) == 3 and all(len(v) == 1 for v in seen.values()):
                tables = [engine.cache.block_table(s.request_id, 0) for s in stream.collector.samples]
                assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full blocks are shared
                assert len({t[2] for t in tables}) == 3  # each sample has its own copy of the partial block
                assert start - engine.num_free_blocks == 2 + 3
        done = stream.completion()
        assert engine.num_free_blocks == start
    assert [s.index for s in done.samples] == [0, 1, 2]
    assert all(s.token_ids == ref for s in done.samples)
    assert seen == {0: ref, 1: ref, 2: ref}


async def test_seeded_parallel_samples_match_single_runs(llama):
    prompt = [5, 6, 7, 8, 9]
    sampling = dict(max_new_tokens=10, temperature=1.0, top_p=0.95, ignore_eos=True)
    async with Engine(llama, config=EngineConfig(block_size=4, num_blocks=40)) as engine:
        together = await engine.generate(Request(prompt, SamplingParams(n=3, seed=21, **sampling)))
        alone = [await engine.generate(Request(prompt, SamplingParams(seed=21 + i, **sampling))) for i in range(3)]
        async for _ in engine.stream(Request(prompt, SamplingParams(n=4, max_new_tokens=100))):
            break
        assert engine.num_free_blocks == 40
    assert [s.token_ids for s in together.samples] == [a.token_ids for a in alone]
    assert len({tuple(s.token_ids) for s in together.samples}) > 1


@pytest.mark.parametrize("eviction", ["mru", "lru", "lfu", "fifo"])
async def test_demotion_starts_at_the_leaves_of_a_cached_prefix_whatever_the_policy(llama, eviction):
    """mru and fifo used to demote a prefix's first block: a repeated prompt then hit none of the 60 cached
    tokens it still counted as cached. Two blocks forced out now cost the prefix its last two blocks only."""
    prompt = [(7 * i) % 250 + 3 for i in range(64)]  # 16 blocks of 4
    stats = Stats()
    config = EngineConfig(block_size=4, num_blocks=20, eviction=eviction, safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[stats]) as engine:
        first = await engine.generate(greedy(prompt, 1))  # 16 full blocks cached, the 17th freed: 4 free
        await engine.generate(greedy([200] * 16, 9))  # 24 tokens computed, 6 blocks: the 4 free ones, 2 demoted
        assert engine.cache.blocks_demoted == 2
        again = await engine.generate(greedy(prompt, 1))
    assert stats.started[first.request_id] == 0
    assert stats.started[again.request_id] == 56  # 14 of its 15 matchable blocks: the 2 leaves went
    assert again.token_ids == first.token_ids


class Recording:
    """A policy that records what the pool tells it (the optional methods of `EvictionPolicy`)."""

    def __init__(self):
        self.calls: list[tuple[str, object]] = []

    def setup(self, num_blocks):
        self.calls.append(("setup", num_blocks))

    def on_insert(self, block):
        self.calls.append(("insert", (block.hash, block.depth, block.extended)))

    def on_hit(self, block):
        self.calls.append(("hit", block.depth))

    def on_demote(self, block):
        self.calls.append(("demote", block.hash))

    def priority(self, block):
        return block.last_access


async def test_a_policy_is_told_of_inserts_hits_and_demotions_with_each_blocks_depth(llama):
    policy = Recording()

    class Registers:
        @hookimpl
        def jitney_register_eviction_policies(self, register):
            register("recording", lambda config: policy)

    prompt = list(range(30, 43))  # 3 full blocks of 4 and a partial one
    config = EngineConfig(block_size=4, num_blocks=8, eviction="recording", safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[Registers()]) as engine:
        await engine.generate(greedy(prompt, 1))
        await engine.generate(greedy(prompt, 1))  # hits its 3 cached blocks
        await engine.generate(greedy([200] * 23, 9))  # 8 blocks: every cached block is demoted
    kinds = [k for k, _ in policy.calls]
    assert policy.calls[0] == ("setup", 8)
    inserted = [v for k, v in policy.calls if k == "insert"]
    assert sorted((depth, extended) for _, depth, extended in inserted[:3]) == [(0, True), (1, True), (2, False)]
    assert [v for k, v in policy.calls if k == "hit"] == [0, 1, 2]
    assert kinds.count("demote") >= 3 and all(v is not None for k, v in policy.calls if k == "demote")


@pytest.mark.parametrize("eviction", ["2q", "lru"])
async def test_2q_keeps_a_reused_prefix_through_a_burst_of_one_off_prompts(llama, eviction):
    shared = list(range(20, 44))  # 6 blocks of 4
    stats = Stats()
    config = EngineConfig(block_size=4, num_blocks=24, eviction=eviction, safety_margin=0.0)
    async with Engine(llama, config=config, plugins=[stats]) as engine:
        for tail in ([1], [2]):  # computed, then reused: a prefix worth keeping
            await engine.generate(greedy(shared + tail, 1))
        for i in range(6):  # one-off prompts, 24 tokens each, seen once: more than the cache holds
            await engine.generate(greedy([60 + 10 * i + k % 7 for k in range(24)], 1))
        last = await engine.generate(greedy(shared + [3], 1))
    kept = stats.started[last.request_id]
    assert kept == (24 if eviction == "2q" else 0)
