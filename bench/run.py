"""`jitney bench`: jitney and transformers on the same model, requests and output lengths, in one run."""

from __future__ import annotations

import argparse
import json
import resource
import time

import anyio
import torch

from jitney.bench.workloads import WORKLOADS, Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed-64", choices=sorted(WORKLOADS))
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--modes", default="jitney,hf-cb,hf-static",
                        help="comma-separated: jitney, hf-cb (transformers continuous batching), hf-static (generate)")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")


def matmul_peak_gflops(seconds: float = 2.0) -> float:
    """Best fp32 matmul rate on this machine, on shapes like a decode step's projections."""
    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        for _ in range(20):
            torch.mm(a, b)
        best = max(best, 20 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t))
    return best / 1e9


def workload_gflop(model, work: Workload) -> float:
    """Matmul work of the workload: projections for every token, attention over each context, the LM head
    for every sampled token."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    flops = 0.0
    for prompt, n in work:
        tokens = len(prompt) + n
        flops += 2 * weights * tokens
        flops += 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * tokens * tokens / 2
        flops += 2 * c.hidden_size * c.vocab_size * n
    return flops / 1e9


def run_jitney(model, tokenizer, work: Workload, args) -> list[list[int]]:
    from jitney import Engine, EngineConfig, Request, SamplingParams

    need = sum(-(-(len(p) + n) // args.block_size) for p, n in work)
    config = EngineConfig(max_batch_tokens=args.max_batch_tokens, block_size=args.block_size, num_blocks=need,
                          max_requests_per_batch=max(64, len(work)))
    engine = Engine(model, tokenizer, config)
    out: list[list[int]] = [[] for _ in work]

    async def main() -> None:
        async with engine:
            async def one(i: int) -> None:
                prompt, n = work[i]
                out[i] = (await engine.generate(Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))).token_ids

            async with anyio.create_task_group() as tg:
                for i in range(len(work)):
                    tg.start_soon(one, i)

    anyio.run(main)
    return out


def run_hf_cb(model, tokenizer, work: Workload, args) -> list[list[int]]:
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=None, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    out = {}
    with model.continuous_batching_context_manager(generation_config=gen, block=True) as manager:
        ids = [manager.add_request(prompt, f"r{i}", max_new_tokens=n) for i, (prompt, n) in enumerate(work)]
        while len(out) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                out[result.request_id] = list(result.generated_tokens)
    return [out[f"r{i}"] for i in range(len(work))]


def run_hf_static(model, tokenizer, work: Workload, args) -> list[list[int]]:
    model.set_attn_implementation("sdpa")
    out = []
    for start in range(0, len(work), args.static_batch):
        chunk = work[start : start + args.static_batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        n = max(k for _, k in chunk)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        out += [gen[i, width : width + k].tolist() for i, (_, k) in enumerate(chunk)]
    return out


RUNNERS = {"jitney": run_jitney, "hf-cb": run_hf_cb, "hf-static": run_hf_static}


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def main(args) -> int:
    from jitney.core.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    work = WORKLOADS[args.workload](model.config.get_text_config().vocab_size)
    out_tokens = sum(n for _, n in work)
    print(f"workload {args.workload}: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt and "
          f"{out_tokens} output tokens; torch threads {torch.get_num_threads()}")
    peak = matmul_peak_gflops()
    gflop = workload_gflop(model, work)
    print(f"fp32 matmul peak {peak:.0f} GFLOP/s; workload {gflop:.0f} GFLOP -> {gflop / peak:.1f} s at the roofline")
    rows, outputs = [], {}
    for mode in args.modes.split(","):
        t = time.perf_counter()
        outputs[mode] = RUNNERS[mode](model, tokenizer, work, args)
        wall = time.perf_counter() - t
        rows.append({
            "mode": mode, "wall_s": round(wall, 2), "output_tok_s": round(out_tokens / wall, 1),
            "roofline_share": round(gflop / peak / wall, 3),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        })
        print(f"  {mode}: {wall:.1f} s", flush=True)
    base = outputs.get("jitney")
    print(f"\n{'mode':<10} {'wall s':>8} {'out tok/s':>10} {'roofline':>9} {'same tokens as jitney':>22} {'peak RSS MiB':>13}")
    for row in rows:
        same = agreement(outputs[row["mode"]], base) if base else float("nan")
        row["same_tokens_as_jitney"] = same
        print(f"{row['mode']:<10} {row['wall_s']:>8.1f} {row['output_tok_s']:>10.1f} {row['roofline_share']:>8.0%} "
              f"{same:>21.0%} {row['peak_rss_mib']:>13}")
    if base:
        for row in rows:
            if row["mode"] != "jitney":
                print(f"jitney / {row['mode']}: {rows[0]['output_tok_s'] / row['output_tok_s']:.2f}x")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"workload": args.workload, "matmul_peak_gflops": peak, "workload_gflop": gflop, "rows": rows}, f, indent=2)
    return 0
