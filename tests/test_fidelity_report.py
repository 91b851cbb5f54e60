"""`jitney fidelity`: a simulation's rows against real runs', policy by policy: signed errors against the real
medians, Kendall's tau over the policies' rankings, `--check` failing past the bound or on a ranking that differs."""

import json

import pytest

from jitney.bench.fidelity import compare, kendall_tau, table
from jitney.cli import main


def test_kendall_tau_counts_pairs_that_agree():
    assert kendall_tau([1, 2, 3], [10, 20, 30]) == 1.0
    assert kendall_tau([1, 2, 3], [30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(4 / 6)
    assert kendall_tau([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / (2 * 3) ** 0.5)  # tau-b: a tie in one ranking
    assert kendall_tau([1], [1]) is None and kendall_tau([1, 1], [2, 3]) is None


def row(eviction: str, wall: float, ttft: float, hit: float, itl: float = 0.0, **extra) -> dict:
    return {"mode": "jitney-nolookup", "scheduler": "fifo", "eviction": eviction, "wall_s": wall, "ttft_p50_ms": ttft,
            "prefix_hit_rate": hit, "itl_p50_ms": itl, **extra}


def test_errors_are_against_the_real_median_and_rankings_compared():
    real = [row("lru", 10.0, 100, 0.5), row("lru", 11.0, 120, 0.5), row("lru", 30.0, 110, 0.5),
            row("mru", 20.0, 200, 0.7), row("mru", 21.0, 210, 0.7)]
    sim = [row("lru", 11.0, 99, 0.5), row("mru", 20.5, 90, 0.7, itl=3.0)]
    result = compare(real, sim, bound=0.10)
    lru = result["cells"]["fifo/lru"]
    assert lru["wall_s"]["real"] == 11.0 and lru["wall_s"]["real_range"] == [10.0, 30.0] and lru["wall_s"]["runs"] == 3
    assert lru["wall_s"]["error"] == pytest.approx(0.0)
    assert result["cells"]["fifo/mru"]["wall_s"]["error"] == pytest.approx(20.5 / 20.5 - 1)
    assert result["cells"]["fifo/mru"]["itl_p50_ms"]["error"] is None  # (a real median of 0: no share of it)
    assert result["kendall_tau"]["wall_s"] == 1.0 and result["kendall_tau"]["ttft_p50_ms"] == -1.0
    assert result["past_bound"] == [("fifo/mru", "ttft_p50_ms")]  # 90 against 205: -56%
    text = table(result)
    assert "| fifo/lru | 11.00 (10.00-30.00) / 11.00 (+0.0%)" in text and "real 0" in text
    assert text.splitlines()[-2].startswith("| Kendall's tau | +1.00 | -1.00")


def test_pairs_whose_real_runs_overlap_are_not_ranked():
    """lru and mru's real walls overlap (10-12 against 11-13): the simulation's order of them is not held against it;
    fifo is told apart from both."""
    real = [row("lru", 10.0, 100, 0.5), row("lru", 12.0, 100, 0.5), row("mru", 11.0, 100, 0.6),
            row("mru", 13.0, 100, 0.6), row("fifo", 20.0, 100, 0.4), row("fifo", 21.0, 100, 0.4)]
    sim = [row("lru", 12.5, 100, 0.5), row("mru", 11.5, 100, 0.6), row("fifo", 19.0, 100, 0.4)]
    result = compare(real, sim)
    assert result["kendall_tau"]["wall_s"] == pytest.approx(1 / 3)  # lru and mru swapped
    assert result["kendall_tau_apart"]["wall_s"] == 1.0  # fifo against each: the same order
    assert result["kendall_tau_apart"]["ttft_p50_ms"] is None  # (no pair told apart)
    assert table(result).splitlines()[-1].startswith("| tau, pairs told apart | +1.00 | - |")


def test_several_simulations_a_policy_are_compared_by_their_median():
    """`jitney simulate --seeds`: the error is the simulations' median against the real runs', both ranges shown."""
    real = [row("lru", 10.0, 100, 0.5), row("lru", 12.0, 300, 0.5), row("lru", 11.0, 200, 0.5)]
    sim = [row("lru", 9.0, 150, 0.5, seed=0), row("lru", 13.0, 250, 0.5, seed=1), row("lru", 11.5, 190, 0.5, seed=2)]
    cell = compare(real, sim)["cells"]["fifo/lru"]["ttft_p50_ms"]
    assert cell["sim"] == 190 and cell["sim_range"] == [150, 250] and cell["sim_runs"] == 3
    assert cell["error"] == pytest.approx(190 / 200 - 1)
    assert "| fifo/lru | 11.00 (10.00-12.00) / 11.50 (9.00-13.00) (+4.5%)" in table(compare(real, sim))


def test_policies_must_match():
    with pytest.raises(ValueError, match="fifo/gdsf"):
        compare([row("lru", 1, 1, 0)], [row("lru", 1, 1, 0), row("gdsf", 1, 1, 0)])
    with pytest.raises(ValueError, match="no eviction policy"):
        compare([{"mode": "hf-cb", "wall_s": 1}], [row("lru", 1, 1, 0)])


def test_the_command_checks_the_bound_and_the_rankings(tmp_path, capsys):
    real, sim = tmp_path / "real.json", tmp_path / "sim.json"
    real.write_text(json.dumps({"rows": [row("lru", 10.0, 100, 0.5), row("mru", 20.0, 200, 0.7),
                                         {"mode": "jitney-nolookup", "failed": True, "reason": "x"}]}))
    sim.write_text(json.dumps({"rows": [row("lru", 10.5, 104, 0.5), row("mru", 19.0, 205, 0.7)]}))
    assert main(["fidelity", "--real", str(real), "--sim", str(sim), "--check"]) == 0
    assert "within 10%" in capsys.readouterr().out
    sim.write_text(json.dumps({"rows": [row("lru", 10.5, 300, 0.5), row("mru", 19.0, 205, 0.7)]}))
    assert main(["fidelity", "--real", str(real), "--sim", str(sim), "--json", str(tmp_path / "f.json")]) == 0
    assert main(["fidelity", "--real", str(real), "--sim", str(sim), "--check"]) == 1
    out = capsys.readouterr().out
    assert "the policies the real runs tell apart rank differently in TTFT p50 ms" in out
    assert json.loads((tmp_path / "f.json").read_text())["kendall_tau"]["ttft_p50_ms"] == -1.0
