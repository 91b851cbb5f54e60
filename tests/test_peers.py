"""llama.cpp as a peer in `jitney bench`: on the same F32 weights, batched, it gives jitney's greedy tokens.
(llama-cpp-python is an optional extra that compiles llama.cpp: `make bench-peers`; without it this skips,
saying so.)"""

from __future__ import annotations

import anyio
import pytest

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.bench import peers
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
