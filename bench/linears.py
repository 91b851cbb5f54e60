"""`python -m jitney.bench.linears`: one linear layer's rate at a number of rows, in jitney's fp32 kernel, in bf16
compute on the unit the kernels chose (`EngineConfig.compute="bf16"`: AMX, AVX512-BF16 or plain C++), and in torch's
bf16 matmul on the same shape (its rows rounded to bf16 as ours are), GFLOP/s each and the faster of the two bf16.

Shapes are a model's own, given as `inputs x outputs` (`g` after it: a gated MLP's gate and up, `outputs` each, the
activation times up out): SmolLM2-135M's MLP (576 x 1536g) and attention (576 x 960), TinyLlama 1.1B's MLP
(2048 x 5632g, 5632 x 2048) by default. Each figure is the median of repeated calls on a thread of torch's."""

from __future__ import annotations

import argparse
import sys
import time

import torch

SHAPES = "576x1536g,576x960,2048x5632g,5632x2048"


def median_seconds(fn, x: torch.Tensor, budget: float = 0.5) -> float:
    fn(x)
    times, end = [], time.perf_counter() + budget
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    from jitney.kernels import cpu_linear, native

    parser = argparse.ArgumentParser(prog="python -m jitney.bench.linears", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help=f"comma-separated inputs x outputs[g] (default {SHAPES})")
    parser.add_argument("--rows", default="1,4,16,64,256", help="comma-separated rows a call (tokens of a step)")
    args = parser.parse_args(argv)
    if not native.available():
        print("jitney's C++ kernels do not build here", file=sys.stderr)
        return 2
    unit = native.load().bf16_unit()
    print(f"bf16 compute on {unit}; torch threads {torch.get_num_threads()}; GFLOP/s (median call)")
    print(f"{'shape':>11} {'rows':>5} {'jitney fp32':>11} {'jitney bf16':>11} {'torch bf16':>10}  bf16: faster")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes.split(","):
        gated = shape.endswith("g")
        k, n = (int(v) for v in shape.removesuffix("g").split("x"))
        weights = [torch.randn(n, k, generator=g) * 0.02 for _ in range(2 if gated else 1)]
        fp32 = cpu_linear.PanelLinear(weights, None, gated=gated)
        bf16 = cpu_linear.PanelLinear(weights, None, gated=gated, compute="bf16")
        stacked = torch.cat(weights).to(torch.bfloat16).T
        half = n if gated else 0  # (torch's: the gated MLP as its two products and the activation)

        def torch_bf16(x: torch.Tensor) -> torch.Tensor:
            y = x.to(torch.bfloat16) @ stacked
            return torch.nn.functional.silu(y[:, :half]) * y[:, half:] if gated else y

        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=g)
            flop = 2 * rows * k * n * (2 if gated else 1)
            rates = [flop / median_seconds(f, x) / 1e9 for f in (fp32, bf16, torch_bf16)]
            faster = "jitney" if rates[1] >= rates[2] else "torch"
            print(f"{shape:>11} {rows:>5} {rates[0]:>11.0f} {rates[1]:>11.0f} {rates[2]:>10.0f}  {faster} "
                  f"{max(rates[1:]) / min(rates[1:]):.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
