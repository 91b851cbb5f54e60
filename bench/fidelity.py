"""`jitney fidelity`: a simulation's rows (`jitney simulate --json`) against real runs of the same workload
(`jitney bench --modes jitney-nolookup --json`, any number of runs a policy), policy by policy: each figure's real
median (and range), the simulated figure and its signed error, and for each figure Kendall's tau between the
policies' real and simulated rankings (1: the same order, -1: reversed), over every pair of policies and over the
pairs the real runs tell apart (their ranges do not overlap: a pair whose runs overlap has no real order for the
simulation to get right). `--check`: exit 1 where a cell is off by more than `--bound` or the pairs told apart are
ranked differently.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from pathlib import Path

FIGURES = {"wall_s": "wall s", "ttft_p50_ms": "TTFT p50 ms", "ttft_p99_ms": "TTFT p99 ms",
           "ttft_mean_ms": "TTFT mean ms", "itl_p50_ms": "ITL p50 ms", "itl_p99_ms": "ITL p99 ms",
           "prefix_hit_rate": "hit rate"}
"""The figures compared, by their rows' keys."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--real", required=True, nargs="+", help="`jitney bench --json` files (their rows pooled)")
    parser.add_argument("--sim", required=True, nargs="+", help="`jitney simulate --json` files (their rows pooled)")
    parser.add_argument("--bound", type=float, default=0.10, help="largest error a cell may have (a share of the real "
                                                                   "median)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 where a cell is past the bound or a figure ranks the policies differently")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the comparison to this file")


def policy(row: dict) -> str:
    """A row's policy: its scheduler and eviction policy."""
    if "eviction" not in row:
        raise ValueError(f"row {row.get('mode')!r} names no eviction policy (rows of `jitney bench` jitney modes "
                         "or `jitney simulate`)")
    return f"{row.get('scheduler', 'fifo')}/{row['eviction']}"


def kendall_tau(a: list[float], b: list[float], pairs: list[tuple[int, int]] | None = None) -> float | None:
    """Kendall's tau-b between two rankings of the same items (ties counted as neither agreeing nor not), over
    `pairs` of their indices (default: every pair); None where it is undefined (no pair, or every pair tied in
    either)."""
    concordant = discordant = ties_a = ties_b = 0
    for i, j in itertools.combinations(range(len(a)), 2) if pairs is None else pairs:
        da, db = a[i] - a[j], b[i] - b[j]
        if da == 0 and db == 0:
            continue
        if da == 0:
            ties_a += 1
        elif db == 0:
            ties_b += 1
        elif (da > 0) == (db > 0):
            concordant += 1
        else:
            discordant += 1
    total = concordant + discordant
    denominator = math.sqrt((total + ties_a) * (total + ties_b))
    return None if denominator == 0 else (concordant - discordant) / denominator


def _by_policy(rows: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for row in rows:
        grouped.setdefault(policy(row), []).append(row)
    return grouped


def compare(real_rows: list[dict], sim_rows: list[dict], bound: float = 0.10) -> dict:
    """Per policy and figure: the real runs' median, their range, the simulated figure (the median of its rows:
    several where `jitney simulate --seeds` drew step-time noise), their range and the signed error of the medians
    (None where the real median is 0); per figure, Kendall's tau over the policies, and the cells
    past `bound`."""
    real, sim = _by_policy(real_rows), _by_policy(sim_rows)
    missing = sorted(set(real) ^ set(sim))
    if missing:
        raise ValueError(f"policies in one set of rows and not the other: {', '.join(missing)}")
    policies = sorted(real)
    cells: dict[str, dict[str, dict]] = {}
    for name in policies:
        cells[name] = {}
        for key in FIGURES:
            values = [row[key] for row in real[name] if row.get(key) is not None]
            simulated = [row[key] for row in sim[name] if row.get(key) is not None]
            if not values or not simulated:
                continue
            median, predicted = statistics.median(values), statistics.median(simulated)
            error = predicted / median - 1 if median else None
            cells[name][key] = {"real": median, "real_range": [min(values), max(values)], "runs": len(values),
                                "sim": predicted, "sim_range": [min(simulated), max(simulated)],
                                "sim_runs": len(simulated), "error": error}
    taus, apart = {}, {}
    for key in FIGURES:
        if all(key in cells[name] for name in policies):
            real_of, sim_of = ([cells[name][key][side] for name in policies] for side in ("real", "sim"))
            taus[key] = kendall_tau(real_of, sim_of)
            ranges = [cells[name][key]["real_range"] for name in policies]
            told = [(i, j) for i, j in itertools.combinations(range(len(policies)), 2)
                    if ranges[i][1] < ranges[j][0] or ranges[j][1] < ranges[i][0]]
            apart[key] = kendall_tau(real_of, sim_of, told)
    past = [(name, key) for name in policies for key, cell in cells[name].items()
            if cell["error"] is not None and abs(cell["error"]) > bound]
    return {"policies": policies, "cells": cells, "kendall_tau": taus, "kendall_tau_apart": apart, "bound": bound,
            "past_bound": past}


def _number(key: str, value: float) -> str:
    return f"{value:.1%}" if key == "prefix_hit_rate" else f"{value:,.2f}" if key == "wall_s" else f"{value:,.1f}"


def _spread(key: str, cell: dict, side: str) -> str:
    """ (low-high) where the side has several runs, else nothing."""
    if cell["runs" if side == "real" else "sim_runs"] < 2:
        return ""
    low, high = cell[f"{side}_range"]
    return f" ({_number(key, low)}-{_number(key, high)})"


def table(result: dict) -> str:
    """The comparison as a markdown table: a row a policy, a column a figure ("real median (range) / sim median
    (range, where several) (error)"),
    and last rows of Kendall's tau, over every pair and over the pairs the real runs tell apart."""
    keys = [key for key in FIGURES if any(key in result["cells"][name] for name in result["policies"])]
    lines = ["| policy | " + " | ".join(f"{FIGURES[key]} real / sim" for key in keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for name in result["policies"]:
        parts = []
        for key in keys:
            cell = result["cells"][name].get(key)
            if cell is None:
                parts.append("-")
                continue
            real, sim = (_number(key, cell[side]) + _spread(key, cell, side) for side in ("real", "sim"))
            error = "real 0" if cell["error"] is None else f"{cell['error']:+.1%}"
            parts.append(f"{real} / {sim} ({error})")
        lines.append(f"| {name} | " + " | ".join(parts) + " |")
    for label, field in (("Kendall's tau", "kendall_tau"), ("tau, pairs told apart", "kendall_tau_apart")):
        taus = [result[field].get(key) for key in keys]
        lines.append(f"| {label} | " + " | ".join("-" if t is None else f"{t:+.2f}" for t in taus) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    rows = {}
    for side in ("real", "sim"):
        rows[side] = [row for path in getattr(args, side) for row in json.loads(Path(path).read_text())["rows"]
                      if "failed" not in row]
    result = compare(rows["real"], rows["sim"], args.bound)
    print(table(result))
    differing = [FIGURES[key] for key, tau in result["kendall_tau_apart"].items() if tau is not None and tau < 1]
    loosely = [FIGURES[key] for key, tau in result["kendall_tau"].items() if tau is not None and tau < 1]
    measured = sum(cell["error"] is not None for cells in result["cells"].values() for cell in cells.values())
    print(f"{measured - len(result['past_bound'])} of {measured} cells within {args.bound:.0%} (a real median of 0 "
          "has no error); the policies the real runs tell apart rank "
          + (f"differently in {', '.join(differing)}" if differing else "the same in every figure")
          + (f"; over every pair, differently in {', '.join(loosely)}" if loosely else ""))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 1 if args.check and (result["past_bound"] or differing) else 0
