"""`jitney quality`: what a weight format or a KV cache's dtype costs in quality, measured. Perplexity of a model on
held-out English text through the engine's own linear kernels, fp32 against int8 weights and int8 weights and
activations (`EngineConfig.weights`), fp32 weights computed in bf16 (`EngineConfig.compute`), and keys and values rounded as a bf16 or int8 cache holds them
(`EngineConfig.kv_cache_dtype`), and how often each one's most likely next token is fp32's (teacher-forced, every
position).

The text is one every Python installation ships: the topics of the language reference that `help()` shows
(`pydoc_data.topics`), in sorted order, a blank line between them. Nothing in jitney is fitted to it (int8
rounding needs no calibration data)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import torch

WEIGHTS = ("fp32", "int8", "w8a8", "bf16", "bf16c")
"""Weight formats (`EngineConfig.weights`), and "bf16c": fp32 weights with bf16 compute (`EngineConfig.compute`)."""
KV = "kv"
"""A kind's suffix, `kv` and an `EngineConfig.kv_cache_dtype` (`int8+kvbf16`): its keys and values rounded as a KV
cache of that dtype holds them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help='a local checkpoint directory, or "smollm2" (default)')
    parser.add_argument("--weights", default="fp32,int8",
                        help="comma-separated: fp32, int8, w8a8, bf16, bf16c (bf16 compute), each optionally +kvbf16 or +kvint8 (keys and "
                             "values rounded as a bf16 or int8 KV cache holds them); the first is the baseline")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens of the text to score (its start)")
    parser.add_argument("--window", type=int, default=1024, help="tokens a forward pass sees (windows do not overlap)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")


def reference_text() -> str:
    """The held-out text: Python's `pydoc_data.topics`, topics in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in sorted(topics))


def score(model, ids: torch.Tensor, window: int) -> tuple[float, torch.Tensor]:
    """Mean negative log-likelihood of every token of `ids` after its window's first, and each such position's
    most likely token."""
    total, count, best = 0.0, 0, []
    with torch.inference_mode():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start : start + window][None]
            if chunk.shape[1] < 2:
                break
            logits = model(input_ids=chunk, use_cache=False).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum")
            total, count = total + nll.item(), count + chunk.shape[1] - 1
            best.append(logits.argmax(-1))
    return total / count, torch.cat(best)


def main(args: argparse.Namespace) -> int:
    from jitney.core.models import load_model
    from jitney.kernels import cpu_linear, native
    from jitney.kernels.base import KV_CACHE_DTYPES, RoundedKV

    kinds = args.weights.split(",")
    for kind in kinds:
        weights, _, kv = kind.partition("+")
        if weights not in WEIGHTS or kv not in ("", *(KV + name for name in KV_CACHE_DTYPES)):
            raise ValueError(f"--weights: unknown {kind!r} (known: {', '.join(WEIGHTS)}, each optionally "
                             f"+{' or +'.join(KV + name for name in KV_CACHE_DTYPES)})")
    if {k.partition("+")[0] for k in kinds} - {"fp32"} and not native.available():
        raise ValueError("int8, w8a8 and bf16 weights and bf16 compute need jitney's C++ kernels, which do not build here")
    if args.tokens < 2 or args.window < 2:
        raise ValueError("--tokens and --window must be at least 2")
    model, tokenizer = load_model(args.model)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer to read the text with")
    ids = torch.tensor(tokenizer(reference_text())["input_ids"][: args.tokens])
    print(f"text: Python's pydoc_data.topics, {len(ids)} tokens scored in windows of {args.window}", flush=True)
    rows, base = [], None
    for kind in kinds:
        t = time.perf_counter()
        weights, _, kv = kind.partition("+")
        rounded_kv = RoundedKV(model, KV_CACHE_DTYPES[kv.removeprefix(KV)]) if kv else contextlib.nullcontext()
        # (the engine's kernels, fp32 too)
        packed = (cpu_linear.PackedLinears(model, compute="bf16") if weights == "bf16c"
                  else cpu_linear.PackedLinears(model, quantized=None if weights == "fp32" else weights))
        with packed, rounded_kv:
            nll, best = score(model, ids, args.window)
        row = {"weights": kind, "perplexity": round(math.exp(nll), 4), "seconds": round(time.perf_counter() - t, 1)}
        if base is None:
            base = (row, best)
        else:
            row["perplexity_vs_first"] = round(row["perplexity"] / base[0]["perplexity"] - 1, 5)
            row["top1_same_as_first"] = round((best == base[1]).float().mean().item(), 4)
        rows.append(row)
        print(f"  {kind}: perplexity {row['perplexity']:.4f} ({row['seconds']} s)", flush=True)
    width = max(8, *map(len, kinds))
    print(f"\n{'weights':<{width}} {'perplexity':>10} {'vs ' + kinds[0]:>9} {'same top-1':>10}")
    for row in rows:
        diff = f"{row['perplexity_vs_first']:+.2%}" if "perplexity_vs_first" in row else "-"
        same = f"{row['top1_same_as_first']:.2%}" if "top1_same_as_first" in row else "-"
        print(f"{row['weights']:<{width}} {row['perplexity']:>10.4f} {diff:>9} {same:>10}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"model": args.model, "text": "pydoc_data.topics", "tokens": len(ids), "window": args.window,
                       "rows": rows}, f, indent=1)
    return 0
