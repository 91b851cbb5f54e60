"""`jitney simulate`: the real scheduler, cache and eviction plugins on a virtual clock, from a model's config
alone; the same prefix hits and prompt tokens as a real run; arrivals honoured; profiles fitted and refused."""

from __future__ import annotations

import random

import anyio
import pytest
from support import tiny_llama

from jitney import Engine, EngineConfig, Request, SamplingParams
from jitney.bench.profile import StepProfile, features, fit, load_profile
from jitney.bench.simulate import Arrival, Timeline, meta_model, simulate
from jitney.core.hooks import hookimpl

CONSTANT = StepProfile(model="tiny", machine="test", coefficients=[0.01, 0, 0, 0, 0], fit_error=0, total_error=0, steps=0)
SHAPED = StepProfile(model="tiny", machine="test", coefficients=[1e-3, 2e-5, 1e-5, 1e-4, 1e-2], fit_error=0,
                     total_error=0, steps=0)


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_llama().config.save_pretrained(folder)
    return folder / "config.json"


def prefixes_workload(seed: int = 3) -> list[Arrival]:
    """48 requests over 6 shared 24-token prefixes, shuffled: the cache cannot hold every prefix."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 256) for _ in range(24)] for _ in range(6)]
    order = [i % 6 for i in range(48)]
    rng.shuffle(order)
    return [Arrival(systems[k] + [rng.randrange(3, 256) for _ in range(rng.randint(1, 6))], rng.randint(2, 8))
            for k in order]


class CountingLru:
    calls = 0

    def priority(self, block):
        CountingLru.calls += 1
        return block.last_access


class Registers:
    @hookimpl
    def jitney_register_eviction_policies(self, register):
        register("counting-lru", lambda config: CountingLru())


CONFIG = dict(block_size=4, num_blocks=40, max_batch_tokens=32, eviction="counting-lru")


def real_run(work: list[Arrival]) -> Timeline:
    timeline = Timeline()
    engine = Engine(tiny_llama(), config=EngineConfig(**CONFIG, speculative_tokens=0), plugins=[timeline, Registers()])

    async def main():
        async with engine, anyio.create_task_group() as tg:
            for a in work:
                tg.start_soon(engine.generate, Request(a.prompt, SamplingParams(max_new_tokens=a.output_tokens,
                                                                                 ignore_eos=True)))

    anyio.run(main)
    return timeline


def test_a_simulation_runs_the_serving_plugins_and_hits_the_prefixes_a_real_run_hits(tiny_config):
    work = prefixes_workload()
    real = real_run(work)
    CountingLru.calls = 0
    row = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[Registers()], **CONFIG)
    assert CountingLru.calls > 0  # the registered policy ranked the simulation's cached blocks
    assert 0 < real.hit < real.query  # some prefixes were evicted, some reused
    assert row["prefix_hit_rate"] == round(real.hit / real.query, 3)
    assert row["prompt_tokens_computed"] == real.prefill
    assert row["steps"] == real.steps
    again = simulate(meta_model(str(tiny_config)), work, SHAPED, plugins=[Registers()], **CONFIG)
    assert again == row  # a virtual clock: the same run, the same figures


def test_virtual_time_is_the_sum_of_the_predicted_steps_and_arrivals_are_honoured(tiny_config):
    model = meta_model(str(tiny_config))
    row = simulate(model, [Arrival([5, 6, 7], 4)], CONSTANT, block_size=4, num_blocks=16)
    assert row["wall_s"] == pytest.approx(0.01 * row["steps"])
    later = simulate(model, [Arrival([5, 6, 7], 4), Arrival([8, 9], 4, arrival_s=100.0)], CONSTANT,
                     block_size=4, num_blocks=16)
    # the engine idles until the second arrives, which then waits one step for its first token, not 100 s
    assert later["wall_s"] == pytest.approx(100.0 + 0.01 * 4)
    assert later["ttft_p99_ms"] == pytest.approx(10.0)


def test_a_profile_fit_recovers_a_non_negative_cost_model():
    rng = random.Random(0)
    truth = [0.004, 5e-4, 0.0, 2e-3, 0.3]
    shapes, seconds = [], []
    for _ in range(200):
        q = [rng.randint(1, 64) if rng.random() < 0.2 else 1 for _ in range(rng.randint(1, 32))]
        ctx = [n + rng.randint(0, 500) for n in q]
        shape = features(q, ctx, len(q))
        shapes.append(shape)
        seconds.append(sum(c * x for c, x in zip(truth, shape)))
    coefficients = fit(shapes, seconds)
    assert all(c >= 0 for c in coefficients)
    assert coefficients == pytest.approx(truth, rel=1e-6, abs=1e-9)


def test_missing_profiles_and_configs_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="jitney calibrate --model nowhere"):
        load_profile(None, "nowhere")
    bad = tmp_path / "profile.json"
    bad.write_text('{"model": 1}')
    with pytest.raises(ValueError, match="not a step-time profile"):
        load_profile(str(bad), "x")
    with pytest.raises(FileNotFoundError, match="no model config"):
        meta_model(str(tmp_path / "missing"))
