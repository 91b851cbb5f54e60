"""The simulator against the engine under load (`make nightly`): one arrival trace that queues and evicts, served
by the embedded model (three runs, each in its own process) and simulated with a profile calibrated here and now,
nine times with seeded step-time noise. Wall time, TTFT mean and p99, ITL p99 and the prefix hit rate of the
simulations' median must come within 10% of the real runs' median."""

import json

import pytest

from jitney.bench.fidelity import compare
from jitney.cli import main

BOUND = 0.10
"""Largest error allowed, as a share of the real runs' median."""

FIGURES = ("wall_s", "ttft_mean_ms", "ttft_p99_ms", "itl_p99_ms", "prefix_hit_rate")
"""The figures that hold. Not the medians: most tokens come in runs of accepted guesses, so the real median gap is 0
ms; and on this trace the median first token sits on a gap between the requests served one prefill step after
their arrival and those served later (the 21st of 40 at ~240 ms or at 300-500), so TTFT p50 moves by a step at
once, in real runs too (231-383 ms over three of one policy). Nine simulations with a profile fitted at 5.5% put it
+4.8% off (225-331 ms), nine with one fitted at 6.5% +39% (237-350, real 227-235). The mean moves a little."""

SEEDS = "9"
"""Simulations, each with its own step-time noise (`jitney simulate --seeds`)."""


@pytest.mark.nightly
def test_a_loaded_trace_simulates_within_the_bound_of_its_real_runs(tmp_path):
    profile = tmp_path / "profile.json"
    for _ in range(3):  # (a fit above calibrate's bound is refused: the machine was noisy, so again)
        if main(["calibrate", "--model", "smollm2", "--out", str(profile)]) == 0:
            break
    else:
        pytest.fail("three calibrations in a row were refused as noisy")
    parts = []
    for kind, seed in (("agentic", "3"), ("bursty", "4")):  # 40 requests at 1 a second, tool prompts reused
        parts.append(tmp_path / f"{kind}.jsonl")
        assert main(["trace", kind, "--requests", "20", "--rate", "0.5", "--seed", seed, "--out", str(parts[-1])]) == 0
    trace = tmp_path / "mixed.jsonl"
    trace.write_text("".join(p.read_text() for p in parts))
    cache = ["--trace", str(trace), "--num-blocks", "250", "--eviction", "lru"]
    assert main(["bench", *cache, "--modes", "jitney-nolookup", "--repeat", "3", "--json", str(tmp_path / "real.json")]) == 0
    simulated = ["--profile", str(profile), "--seeds", SEEDS, "--json", str(tmp_path / "sim.json")]
    assert main(["simulate", *cache, *simulated]) == 0
    real = json.loads((tmp_path / "real.json").read_text())["rows"]
    sim = json.loads((tmp_path / "sim.json").read_text())["rows"]
    assert len(real) == 3 and len(sim) == int(SEEDS)
    assert all(row["blocks_evicted"] > 0 for row in sim)  # (a cache that evicts: what a policy study needs)
    [cells] = compare(real, sim, BOUND)["cells"].values()
    errors = {figure: cells[figure]["error"] for figure in FIGURES}
    report = ", ".join(f"{figure} {error:+.1%}" for figure, error in errors.items())
    assert all(abs(error) <= BOUND for error in errors.values()), f"simulated against real: {report}"
