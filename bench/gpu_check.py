"""One script for a machine with an NVIDIA GPU: check the GPU paths, then time them.

    python -m jitney.bench.gpu_check [--model smollm2] [--device cuda] [--quick]

1. The Triton backend against the torch reference on random paged steps (decode and prefill, block sizes
   16/32, GQA ratios 1/3/4, windows), outputs compared elementwise.
2. Greedy tokens of jitney equal to `model.generate` for a few prompts, in each execution mode: eager,
   CUDA graphs, CUDA graphs with async batching (Triton backend), and graphs with the torch backend.
3. mixed-64 (or a quick 16-request slice): jitney in those modes against transformers' continuous
   batching, same requests, one table.

`TRITON_INTERPRET=1 python -m jitney.bench.gpu_check --device cpu` runs steps 1 and 2 in Triton's interpreter,
to check the script itself.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def check_kernels(device: str) -> list[str]:
    import torch

    from jitney.cache.manager import CacheManager
    from jitney.kernels.base import StepInputs
    from jitney.kernels.torch_paged import TorchPagedAttention
    from jitney.kernels.triton_paged import TritonPagedAttention

    failures = []
    for block_size in (16, 32):
        for heads, kv_heads in ((4, 4), (9, 3), (8, 2)):
            for window in (None, 24):
                dim = 64
                cache = CacheManager(1, kv_heads, dim, block_size, 128, torch.float32, torch.device(device))
                shapes = [(37, 1), (300, 1), (0, 1), (0, 90), (40, 33), (5, 17)]
                for i, (c, n) in enumerate(shapes):
                    cache.reserve(str(i), c + n)
                tables = [cache.block_table(str(i), 0) for i in range(len(shapes))]
                width = max(map(len, tables))
                step = StepInputs(
                    query_lens=[n for _, n in shapes], context_lens=[c + n for c, n in shapes], num_decodes=3,
                    positions=torch.cat([torch.arange(c, c + n) for c, n in shapes]).to(device),
                    block_tables=[torch.tensor([t + [128] * (width - len(t)) for t in tables], device=device)],
                    group_of_layer=[0], block_size=block_size, padding_slot=cache.padding_slot,
                    keys=cache.keys, values=cache.values,
                )
                # the cached part of every context: random, as earlier steps would have written it
                for store in cache.keys + cache.values:
                    store.normal_()
                    store[cache.padding_slot :] = 0
                t = step.positions.numel()
                q = torch.randn(1, heads, t, dim, device=device)
                k = torch.randn(1, kv_heads, t, dim, device=device)
                v = torch.randn(1, kv_heads, t, dim, device=device)
                want = TorchPagedAttention().prepare(step)(0, q, k, v, dim ** -0.5, window)
                got = TritonPagedAttention().prepare(step)(0, q, k, v, dim ** -0.5, window)
                err = (got - want).abs().max().item()
                label = f"block {block_size}, heads {heads}/{kv_heads}, window {window}"
                print(f"  kernels  {label:<32} max |diff| {err:.2e}")
                if not err < 1e-4:
                    failures.append(f"kernels differ: {label}: {err}")
    return failures


def engine_modes(device: str) -> dict[str, dict]:
    """jitney's execution modes on this device, as EngineConfig fields (off CUDA: padded steps stand in for graphs)."""
    graphs = {"use_cuda_graph": True} if device == "cuda" else {"q_padding_interval_size": 8, "kv_padding_interval_size": 64}
    return {
        "triton eager": {"attention_backend": "triton", "use_cuda_graph": False, "use_async_batching": False},
        "triton graphs": {"attention_backend": "triton", "use_async_batching": False, **graphs},
        "triton graphs+async": {"attention_backend": "triton", "use_async_batching": True, **graphs},
        "torch graphs+async": {"attention_backend": "torch", "use_async_batching": True, **graphs},
    }


def check_greedy(model, tokenizer, device: str) -> list[str]:
    import anyio
    import torch

    from jitney import Engine, EngineConfig, Request, SamplingParams

    prompts = ["Once upon a time, there was a little", "The capital of France is", "def fibonacci(n):"]
    refs = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids.to(device)
        with torch.inference_mode():
            refs.append(model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist())

    failures = []
    for label, fields in engine_modes(device).items():
        async def run():
            config = EngineConfig(max_batch_tokens=64, num_blocks=256, **fields)
            async with Engine(model, tokenizer, config) as engine:
                outs = [None] * len(prompts)

                async def one(i):
                    outs[i] = (await engine.generate(Request(prompts[i], SamplingParams(max_new_tokens=24)))).token_ids

                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(one, i)
                return outs, engine.executor.static

        outs, static = anyio.run(run)
        bad = [p for p, o, r in zip(prompts, outs, refs) if o != r]
        graphs = f", {static.captures} shapes built, {static.replays} replays" if static is not None else ""
        print(f"  greedy   {label:<20} {len(prompts) - len(bad)}/{len(prompts)} prompts identical to generate{graphs}")
        failures += [f"greedy tokens differ ({label}) for {p!r}" for p in bad]
    return failures


def time_modes(model, tokenizer, quick: bool) -> None:
    from jitney.bench.run import run_hf_cb, run_jitney
    from jitney.bench.workloads import mixed_64

    work = mixed_64(model.config.get_text_config().vocab_size)[: 16 if quick else 64]
    out_tokens = sum(n for _, n in work)
    args = argparse.Namespace(max_batch_tokens=512, block_size=32, num_blocks=None, cache_share=None,
                              cpu_offload_space=0.0, safety_margin=None, attention=None)
    runs = [(f"jitney[{label}]", lambda fields=fields: run_jitney(model, tokenizer, work, args, **fields))
            for label, fields in engine_modes("cuda").items()]
    rows = []
    for label, run in runs + [("hf-cb", lambda: run_hf_cb(model, tokenizer, work, args))]:
        t = time.perf_counter()
        run()
        wall = time.perf_counter() - t
        rows.append((label, wall, out_tokens / wall))
        print(f"  timing   {label:<28} {wall:8.1f} s {out_tokens / wall:9.1f} out tok/s", flush=True)
    base = dict((r[0], r[2]) for r in rows)["hf-cb"]
    print("\n| mode | wall s | output tok/s | vs transformers CB |\n|---|---|---|---|")
    for label, wall, rate in rows:
        print(f"| {label} | {wall:.1f} | {rate:.1f} | {rate / base:.2f}x |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="16 requests instead of 64 in the timing")
    args = parser.parse_args(argv)
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads the variable when it is first imported, before this script runs
        print("on CPU, run it as: TRITON_INTERPRET=1 python -m jitney.bench.gpu_check --device cpu")
        return 2
    import torch

    from jitney.core.models import load_model

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu to check the script in Triton's interpreter")
        return 2
    print(f"device: {torch.cuda.get_device_name() if args.device == 'cuda' else 'cpu (Triton interpreter)'}")
    failures = check_kernels(args.device)
    model, tokenizer = load_model(args.model)
    model.to(args.device)
    failures += check_greedy(model, tokenizer, args.device)
    if args.device == "cuda":
        time_modes(model, tokenizer, args.quick)
    for failure in failures:
        print("FAIL:", failure)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
