"""llama.cpp as a peer in `jitney bench`: on the same F32 weights, batched, it gives jitney's greedy tokens.
(llama-cpp-python is an optional extra that compiles llama.cpp: `make bench-peers`; without it this skips,
saying so.)"""

from __future__ import annotations

import anyio
import pytest

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.bench import peers
from jitney.bench.isolation import run_peer
from jitney.bench.workloads import mixed_64

pytestmark = pytest.mark.skipif(peers.available() is not None, reason=str(peers.available()))


def test_llama_cpp_batched_on_the_same_f32_weights_gives_jitneys_tokens():
    work = [(prompt[:40], 12) for prompt, _ in mixed_64(49152)[:6]]
    theirs, _, wall = peers.run_llama_cpp(peers.f32_gguf(), work, threads=2)
    assert wall > 0 and [len(t) for t in theirs] == [12] * 6

    async def ours():
        async with Engine.from_pretrained("smollm2", config=EngineConfig(num_blocks=64)) as engine:
            return [(await engine.generate(Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))).token_ids
                    for p, n in work]

    mine = anyio.run(ours)
    # (two fp32 implementations sum in different orders: a near-tie may go either way, so most, not all)
    assert sum(a == b for a, b in zip(theirs, mine)) >= 5, (theirs, mine)


def test_llama_cpp_q4_runs_in_a_child_repacked_or_else_plain_and_says_which():
    work = [(prompt[:40], 8) for prompt, _ in mixed_64(49152)[:3]]
    tokens, stats, wall = run_peer(peers.PEERS["llama-cpp-q4"], work, threads=2)
    assert wall > 0 and [len(t) for t in tokens] == [8] * 3 and stats.peak_rss_mib > 0
    # (on CPUs where the repacked Q4_1 crashes, the plain one ran)
    assert stats.note == "repacked" or stats.note.startswith("no repack (repacked run killed by SIG")
    plain, _, _ = peers.run_llama_cpp(peers.embedded_gguf(), work, threads=2, repack=False)
    assert [len(t) for t in plain] == [8] * 3
