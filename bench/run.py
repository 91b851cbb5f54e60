"""`jitney bench`: jitney, transformers and llama.cpp on the same model, requests and output lengths, in one run.

jitney's and transformers' modes run in this process, on the model loaded once; peers (llama.cpp,
`jitney.bench.peers`) each in a child process, so that one crashing gives a failed row and the others still
make the table."""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from types import SimpleNamespace

import anyio
import torch

from jitney.bench.isolation import Peer, PeerFailed, PeerStats, run_in_child, run_peer
from jitney.bench.peers import PEERS
from jitney.bench.profile import StepRecorder
from jitney.bench.stats import StepStats, mean_ms, percentile_ms
from jitney.bench.workloads import (ARRIVING, MODEL_SHAPES, TAKES_TOKENIZER, WORKLOADS, Workload, json_schemas,
                                    long_prompt, shaped_model)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="mixed-64", choices=sorted([*WORKLOADS, *ARRIVING]))
    parser.add_argument("--timeline", default=None, metavar="FILE.png",
                        help="draw each jitney run's schedule (the mode appended to the name when several)")
    parser.add_argument("--timeline-axis", default="step", choices=["step", "time"],
                        help="the timeline's x-axis: steps, or seconds")
    parser.add_argument("--trace", default=None, help="replay a JSONL trace instead, arrivals honoured (jitney modes only)")
    parser.add_argument("--model", default="smollm2",
                        help=f'a checkpoint directory, "smollm2", or a shape with random weights: {", ".join(MODEL_SHAPES)}')
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="convert the model to this dtype after loading (every mode runs the converted model)")
    parser.add_argument("--tokens", dest="tokens_path", default=None,
                        help="also write each mode's generated tokens to this JSON file (to compare runs, e.g. dtypes)")
    parser.add_argument("--modes", default="jitney,hf-cb,hf-static",
                        help="comma-separated: jitney, jitney-nocache (prefix caching off), jitney-nospec "
                             "(speculative decoding off: the draft and prompt lookup), jitney-nolookup (prompt lookup off), "
                             "jitney-unfused (transformers' layers over the packed linears, no one-call decoder), jitney-int8 / jitney-w8a8 / jitney-bf16 (int8 weights / and activations / bf16 weights), "
                             "jitney-bf16c (bf16 compute: EngineConfig.compute), "
                             "jitney-kvbf16 / jitney-kvint8 (a bf16 / int8 KV cache), "
                             "jitney-json (each reply held to a JSON schema: json-16's own, any JSON object elsewhere), "
                             "jitney-noscreen (every logit of greedy rows computed), "
                             "hf-cb (transformers continuous batching), hf-static (transformers generate), llama-cpp / llama-cpp-q4 (llama.cpp on the same weights in F32 "
                             "/ the embedded Q4_1; `make bench-peers`; each in a child process: a crash fails its row only)")
    parser.add_argument("--eviction", default="mru", help="comma-separated eviction policies: one jitney run each")
    parser.add_argument("--scheduler", default="fifo", help="jitney's scheduler (a registered name)")
    parser.add_argument("--num-blocks", type=int, default=None, help="jitney's cache size (default: the whole workload fits)")
    parser.add_argument("--cache-share", type=float, default=None,
                        help="jitney's cache as a share of what the workload needs at once (e.g. 0.25)")
    parser.add_argument("--attention", default=None, help="jitney's attention backend (default: by device)")
    parser.add_argument("--safety-margin", type=float, default=None, help="jitney's safety margin (default: the scheduler's)")
    parser.add_argument("--cpu-offload-space", type=float, default=0.0, help="GiB of swap pool for jitney (0: soft reset only)")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="jitney's EngineConfig.speculative_tokens (default: the engine's; jitney-nospec: 0)")
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="jitney's EngineConfig.lookup_tokens (default: the engine's; jitney-nospec, "
                             "jitney-nolookup: 0)")
    parser.add_argument("--async-batching", action="store_true",
                        help="jitney launches each decode step before handing out the previous one's tokens")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["bf16", "int8"],
                        help="every jitney mode's EngineConfig.kv_cache_dtype (e.g. with jitney-int8: int8 weights over a "
                             "bf16 cache); jitney-kvbf16 / jitney-kvint8 are jitney with bf16 / int8")
    parser.add_argument("--compute", default=None, choices=["fp32", "bf16"],
                        help="every jitney mode's EngineConfig.compute (default: the engine's, bf16 for a bf16 model on "
                             "AMX or AVX512-BF16; e.g. fp32 to time a bf16 model's fp32 path); jitney-bf16c is jitney with bf16")
    parser.add_argument("--packed-cache", action="store_true",
                        help="every jitney mode's EngineConfig.packed_cache: the packed weights kept on disk, mapped by "
                             "a later run of the same model (its start-up is then a second start's)")
    parser.add_argument("--in-process", action="store_true",
                        help="run the jitney modes in this process, one after another (faster; but each run then "
                             "inherits the allocator's state, warm caches and the peak RSS of those before it); by "
                             "default each runs in a fresh child process that loads the model itself")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run every mode this many times, each pass in the reverse order of the one before (no "
                             "mode always first while the machine drifts); rows carry their pass, and the medians "
                             "of each mode's passes are printed and reported")
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--chunk-context-cost", type=float, default=None,
                        help="jitney's EngineConfig.chunk_context_cost (default: the model's; 0: a chunk counts its tokens only)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--null-executor", action="store_true",
                        help="only time the engine without the model (scheduler, cache, step preparation, bus) at 256 requests")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the results to this file")
    parser.add_argument("--plot", dest="plot_path", default=None, help="also draw them into this PNG (needs matplotlib)")


def matmul_peak_gflops(seconds: float = 2.0, compute: str = "fp32") -> float:
    """Best fp32 matmul rate on this machine, on shapes like a decode step's projections: the faster of
    torch's matmul and jitney's own kernel where it builds (on some CPUs torch's library runs at half the
    rate the cores give, and a roofline under what the engine itself reaches would flatter every share).
    `compute="bf16"`: the rate of bf16 products summed in fp32 (`EngineConfig.compute`), torch's bf16 matmul or
    jitney's kernel on the unit it chose (`bf16_unit`), the faster.

    Measured on a thread that then ends: parallel torch work on the main thread leaves an OpenMP team
    behind, which slowed the engine's forward thread at batch 1 by a third or more in our runs."""
    return _on_a_thread_that_ends(_matmul_peak, seconds, compute)


def _on_a_thread_that_ends(fn, *args):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def _matmul_peak(seconds: float, compute: str = "fp32") -> float:
    from jitney.kernels import cpu_linear, native

    a, b = torch.randn(256, 576), torch.randn(576, 1536)
    if compute == "bf16":
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        candidates = [lambda: torch.mm(a16, b16)]
        if native.available():
            linear = cpu_linear.PanelLinear([b.t().contiguous()], None, compute="bf16")
            candidates.append(lambda: linear(a))
    else:
        candidates = [lambda: torch.mm(a, b)]
        if native.available():
            kernels = native.load()
            packed = kernels.pack_panels([b.t().contiguous()])
            candidates.append(lambda: kernels.panel_linear(a, packed, b.shape[1], None))
    best = 0.0
    for mm in candidates:
        end = time.perf_counter() + seconds / len(candidates)
        while time.perf_counter() < end:
            t = time.perf_counter()
            for _ in range(20):
                mm()
            best = max(best, 20 * 2 * a.shape[0] * a.shape[1] * b.shape[1] / (time.perf_counter() - t))
    return best / 1e9


def read_rate_gbps(seconds: float = 1.0) -> float:
    """Best plain read rate of this machine's memory (a 256 MiB sum, torch's threads), GB/s; on a thread that
    ends, like `matmul_peak_gflops`."""
    return _on_a_thread_that_ends(_read_rate, seconds)


def _read_rate(seconds: float) -> float:
    data = torch.ones(64 << 20)  # 256 MiB: far beyond the caches
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        data.sum()
        best = max(best, data.numel() * 4 / (time.perf_counter() - t))
    return best / 1e9


def weight_bytes(model) -> int:
    """Bytes a decode step reads for its weights: every parameter once (a tied LM head and embedding once),
    except an untied input embedding, of which a step reads only its tokens' rows."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    skip = set() if head is not None and head.weight is embed.weight else {id(embed.weight)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def linear_weights(model) -> int:
    """Weights a token goes through in the decoder layers' linears (every 2-D parameter but the embeddings and
    the LM head)."""
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)


def linear_gflop(model, work: Workload) -> float:
    """The part of `workload_gflop` in the decoder layers' linears (what `EngineConfig.compute` computes in)."""
    return sum(2 * linear_weights(model) * (len(prompt) + n) for prompt, n in work) / 1e9


def workload_gflop(model, work: Workload) -> float:
    """Matmul work of the workload computed from scratch (no prefix reuse): projections for every token,
    attention over each context, the LM head for every sampled token."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    weights = linear_weights(model)
    flops = 0.0
    for prompt, n in work:
        tokens = len(prompt) + n
        flops += 2 * weights * tokens
        flops += 4 * c.num_hidden_layers * c.num_attention_heads * head_dim * tokens * tokens / 2
        flops += 2 * c.hidden_size * c.vocab_size * n
    return flops / 1e9


def step_flops(model, shapes: list[list[float]]) -> list[tuple[float, float]]:
    """Each step's floating-point operations (`shapes`: `profile.features` of each): all but the decoder layers'
    linears' (the LM head over the rows it samples, attention, the draft's passes), and those linears' over its
    query tokens."""
    from jitney.bench.profile import FEATURES

    mc = model.config.get_text_config()
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    linear, head = linear_weights(model), mc.hidden_size * mc.vocab_size
    attention = 4 * mc.num_hidden_layers * mc.num_attention_heads * head_dim  # multiply-adds x 2 per query and position
    flops = []
    for shape in shapes:
        f = dict(zip(FEATURES, shape))
        other = (2 * linear * f["draft_tokens"] + 2 * head * (f["sampled_rows"] + f["draft_tokens"]) + attention
                 * (1e3 * (f["decode_kv_ktokens"] + f["draft_kv_ktokens"]) + 1e6 * f["prefill_attention_mtokens2"]))
        flops.append((other, 2 * linear * f["query_tokens"]))
    return flops


def prompt_step_rate(model, shapes: list[list[float]], seconds: list[float], least: int = 128) -> tuple[int, float]:
    """The steps of a run that computed at least `least` query tokens (prompt chunks, with the decode rows beside
    them) and no draft: how many, and their operations (`step_flops`) over the seconds their forwards took, in
    GFLOP/s (0.0 where there were none)."""
    from jitney.bench.profile import FEATURES

    flop = took = 0.0
    steps = 0
    for shape, t, both in zip(shapes, seconds, step_flops(model, shapes)):
        f = dict(zip(FEATURES, shape))
        if f["query_tokens"] >= least and not f["draft_passes"]:
            flop, took, steps = flop + sum(both), took + t, steps + 1
    return steps, flop / took / 1e9 if took else 0.0


def attainable_seconds(model, shapes: list[list[float]], gflops: float, gbps: float, weights: str | None,
                       kv_itemsize: float = 4, linear_gflops: float | None = None) -> float:
    """The roofline of the steps a run took (`profile.features` of each): a step takes at least its multiply-adds
    at the matmul peak `gflops`, and at least its reads at the memory read rate `gbps`: every weight once (the
    packed copy's bytes: `weights` "int8" / "w8a8" a quarter of fp32's, "bf16" half; a speculative step's
    draft passes an int8 copy each) and the KV blocks its decode rows read (distinct ones once; `kv_itemsize`
    bytes an element: 2 for a bf16 cache, 68 / 64 for int8 rows of 64 codes and a scale). Summed over steps, the
    longer of the two each: compute and memory overlapped perfectly, nothing else counted. `linear_gflops`: the
    peak the decoder layers' linears run at where it is not `gflops` (bf16 compute); the draft's as `gflops`."""
    from jitney.bench.profile import FEATURES

    mc = model.config.get_text_config()
    heads, layers = mc.num_attention_heads, mc.num_hidden_layers
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    kv_bytes = 2 * layers * kv_heads * head_dim * kv_itemsize
    read = weight_bytes(model) * {"int8": 0.25, "w8a8": 0.25, "bf16": 0.5}.get(weights, 1.0)
    draft = weight_bytes(model) * 0.25 * (4 / next(model.parameters()).element_size())
    total = 0.0
    for shape, (flop, linear_flop) in zip(shapes, step_flops(model, shapes)):
        f = dict(zip(FEATURES, shape))
        seconds = flop / (gflops * 1e9) + linear_flop / ((linear_gflops or gflops) * 1e9)
        byte = read + f["draft_passes"] * draft + 1e3 * f["decode_kv_distinct_ktokens"] * kv_bytes
        total += max(seconds, byte / (gbps * 1e9))
    return total


def run_jitney(model, tokenizer, work: Workload, args, eviction: str = "mru", sharing: bool = True,
               attention: str | None = None, structured: bool = False, **config_fields):
    """Run the workload through jitney (each request submitted at its `args.arrivals` second, when given);
    `config_fields` override `EngineConfig` fields. `structured`: each reply held to a JSON schema (json-16's own,
    any JSON object on other workloads), ending where the JSON does, not at its token count."""
    begin = time.perf_counter()  # (start-up: from here to the first request; the model's loading is not in it)
    from jitney import Engine, EngineConfig, Grammar, Request, SamplingParams

    need = sum(-(-(len(p) + n) // args.block_size) for p, n in work)
    num_blocks = args.num_blocks or (int(need * args.cache_share) if args.cache_share else need)
    fields = dict(max_batch_tokens=args.max_batch_tokens, block_size=args.block_size, num_blocks=num_blocks,
                  max_requests_per_batch=max(64, len(work)), eviction=eviction, allow_block_sharing=sharing,
                  cpu_offload_space=args.cpu_offload_space, safety_margin=args.safety_margin,
                  scheduler=getattr(args, "scheduler", "fifo"),
                  attention_backend=attention or args.attention,
                  chunk_context_cost=getattr(args, "chunk_context_cost", None),
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", None), compute=getattr(args, "compute", None),
                  packed_cache=getattr(args, "packed_cache", False))
    if getattr(args, "async_batching", False):
        fields["use_async_batching"] = True
    if getattr(args, "speculative_tokens", None) is not None:
        fields["speculative_tokens"] = args.speculative_tokens
    if getattr(args, "lookup_tokens", None) is not None:
        fields["lookup_tokens"] = args.lookup_tokens
    config = EngineConfig(**{**fields, **config_fields})
    stats = StepStats()
    plugins: list = [stats]
    if getattr(args, "timeline", None):
        from jitney.plugins.timeline import ScheduleTimeline

        plugins.append(schedule := ScheduleTimeline())
    engine = Engine(model, tokenizer, config, plugins=plugins)
    stats.recorder = StepRecorder(engine.executor)  # (each step's shape, for `attainable_seconds`)
    k0, mc = engine.cache.keys[0], model.config.get_text_config()
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    # (bytes an element: an int8 row's scale counted in)
    stats.weights, stats.kv_itemsize = config.weights, k0.element_size() * k0.shape[-1] / head_dim
    stats.compute = engine.config.compute  # (resolved: a bf16 model's default may be bf16)
    stats.eviction, stats.scheduler = eviction, config.scheduler
    arrivals = getattr(args, "arrivals", None)
    out: list[list[int]] = [[] for _ in work]
    schemas = json_schemas(len(work)) if getattr(args, "workload", None) == "json-16" else [None] * len(work)
    grammars = {Grammar.json(schema) for schema in schemas} if structured else set()
    params = [SamplingParams(max_new_tokens=n, grammar=Grammar.json(schema)) if structured
              else SamplingParams(max_new_tokens=n, ignore_eos=True) for (_, n), schema in zip(work, schemas)]

    serving = 0.0

    async def main() -> None:
        nonlocal serving
        async with engine:
            for grammar in grammars:  # (the tokenizer's index, ~0.3 s once, and each schema: start-up, as a server does)
                engine.grammars.grammar(grammar)
            t0 = time.perf_counter()  # after start-up (weight packing), like the other modes
            stats.startup_s = t0 - begin

            async def one(i: int) -> None:
                prompt = work[i][0]
                if arrivals:
                    await anyio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
                last = time.perf_counter()
                extra = {}
                if getattr(args, "replay", None):
                    extra = {"priority": args.replay[i].priority, "metadata": args.replay[i].metadata}
                async for tok in engine.stream(Request(prompt, params[i], **extra)):
                    now = time.perf_counter()
                    if out[i]:
                        stats.gaps.append(now - last)
                    out[i].append(tok.token_id)
                    last = now

            decoder = engine.executor.decoder  # (the one-call decoder times its attention)
            attention = decoder.native.attention_seconds if decoder is not None else None
            sampling = engine.executor.sampling_s
            async with anyio.create_task_group() as tg:
                for i in range(len(work)):
                    tg.start_soon(one, i)
            serving = time.perf_counter() - t0
            stats.sampling_s = engine.executor.sampling_s - sampling
            if decoder is not None:
                stats.attention_s = decoder.native.attention_seconds - attention
            decoder = None  # (held past the exit, it would keep the packed copies while the weights are put back)
            stats.memory = engine.memory()  # (entered: the packed parts are there)
            served = time.perf_counter()
        stats.shutdown_s = time.perf_counter() - served  # (the weights unpacked back into the model)

    anyio.run(main)
    if getattr(args, "timeline", None):
        label = f"{eviction}-{'shared' if sharing else 'nocache'}"
        path = args.timeline if getattr(args, "single_jitney_run", True) else args.timeline.replace(".png", f"-{label}.png")
        schedule.draw(path, f"jitney: {getattr(args, 'workload', '')}, {len(work)} requests",
                      axis=getattr(args, "timeline_axis", "step"))
    return out, stats, serving


def run_jitney_apart(model, tokenizer, work: Workload, args, **kw):
    """`run_jitney` in a fresh child process that loads the model itself (`load_bench_model`): each run starts from
    nothing (no allocator state, warm caches or peak RSS carried over from the run before), and its stats carry its
    own start-up and peak RSS. A child that crashes raises `PeerFailed`, which fails its row alone."""
    (out, stats, wall), stats_rss = run_in_child(_jitney_child, args, work, kw)
    stats.peak_rss_mib = stats_rss
    return out, stats, wall


def _jitney_child(args, work: Workload, kw: dict):
    model, tokenizer = load_bench_model(args)
    out, stats, wall = run_jitney(model, tokenizer, work, args, **kw)
    # (the step shapes and times alone travel back)
    stats.recorder = SimpleNamespace(shapes=stats.recorder.shapes, seconds=stats.recorder.seconds)
    return out, stats, wall


def load_bench_model(args, meta: bool = False):
    """The model `args.model` names and its tokenizer (None for a shape, whose random weights are seeded), in
    `args.dtype`, loaded straight in it; `meta`: its shapes alone, no weights (a process whose jitney runs each load
    their own reads only shapes: the roofline, the bytes a token reads)."""
    from jitney.core.models import checkpoint_path, load_model, load_tokenizer

    torch.manual_seed(0)
    dtype = getattr(torch, getattr(args, "dtype", "float32"))
    if args.model in MODEL_SHAPES:
        with torch.device("meta") if meta else nullcontext():
            return shaped_model(args.model, dtype), None
    if meta:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(checkpoint_path(args.model))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype).eval(), load_tokenizer(args.model)
    model, tokenizer = load_model(args.model, dtype=dtype)  # (straight in it: no fp32 copy)
    if next(model.parameters()).dtype != dtype:
        model = model.to(dtype)
    return model, tokenizer


def run_hf_cb(model, tokenizer, work: Workload, args):
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in work), eos_token_id=None, pad_token_id=0)
    model.set_attn_implementation("sdpa")
    out, begin = {}, time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen, block=True) as manager:
        t0 = time.perf_counter()  # after the manager's start-up
        ids = [manager.add_request(prompt, f"r{i}", max_new_tokens=n) for i, (prompt, n) in enumerate(work)]
        while len(out) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                out[result.request_id] = list(result.generated_tokens)
        serving = time.perf_counter() - t0
    times = SimpleNamespace(startup_s=t0 - begin, shutdown_s=time.perf_counter() - t0 - serving)
    return [out[f"r{i}"] for i in range(len(work))], times, serving


def run_hf_static(model, tokenizer, work: Workload, args):
    model.set_attn_implementation("sdpa")
    t0 = time.perf_counter()
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
    return out, None, time.perf_counter() - t0


def _check_llama_cpp(args) -> None:
    from jitney.bench import peers

    why = peers.available()
    if why:
        raise ValueError(f"the llama-cpp modes need llama.cpp: {why}")
    if args.model != "smollm2":
        raise ValueError("the llama-cpp modes run the embedded SmolLM2's GGUF: use them with --model smollm2")


JITNEY_MODES: dict[str, dict] = {
    "jitney": {}, "jitney-nocache": {"sharing": False},
    "jitney-nospec": {"speculative_tokens": 0, "lookup_tokens": 0}, "jitney-nolookup": {"lookup_tokens": 0},
    "jitney-unfused": {"fuse_cpu_layers": False}, "jitney-noscreen": {"lm_head_screen": False},
    "jitney-int8": {"weights": "int8"}, "jitney-w8a8": {"weights": "w8a8"}, "jitney-bf16": {"weights": "bf16"},
    "jitney-bf16c": {"compute": "bf16"}, "jitney-kvbf16": {"kv_cache_dtype": "bf16"},
    "jitney-kvint8": {"kv_cache_dtype": "int8"}, "jitney-json": {"structured": True},
}
"""Each jitney mode and the `run_jitney` arguments it runs with (every one of them once per `--eviction` policy)."""


def eviction_policies(args) -> list[str]:
    """The `--eviction` policies, each checked against those registered (a misspelled one is an error before any
    run, not a run under another policy)."""
    from jitney.core.hooks import make_plugin_manager, registry

    known = registry(make_plugin_manager(), "eviction policy").factories
    policies = [p.strip() for p in args.eviction.split(",") if p.strip()]
    unknown = [p for p in policies if p not in known]
    if unknown or not policies:
        raise ValueError(f"unknown eviction policy {', '.join(map(repr, unknown)) or '(none given)'}; registered: "
                         f"{', '.join(sorted(known))}")
    return policies


def runs(args, peers: Mapping[str, Peer] = PEERS) -> list[tuple[str, Callable]]:
    """(label, runner) for each requested mode; each jitney mode runs once per eviction policy (labelled
    ``mode[policy]`` unless the one policy is the default); `peers` by name, each run in a child process (its
    runner raises `PeerFailed` when that child crashes)."""
    out = []
    policies = eviction_policies(args)
    for mode in args.modes.split(","):
        if mode in JITNEY_MODES:
            for policy in policies:
                label = mode if policies == ["mru"] else f"{mode}[{policy}]"
                run = run_jitney if getattr(args, "in_process", True) else run_jitney_apart
                out.append((label, lambda m, t, w, a, p=policy, kw=JITNEY_MODES[mode], run=run:
                            run(m, t, w, a, eviction=p, **kw)))
        elif mode in ("hf-cb", "hf-static"):
            out.append((mode, run_hf_cb if mode == "hf-cb" else run_hf_static))
        elif mode in peers:
            if mode.startswith("llama-cpp"):
                _check_llama_cpp(args)  # (before any mode runs, not after the others' minutes)
            out.append((mode, lambda m, t, w, a, p=peers[mode]: run_peer(p, w, torch.get_num_threads())))
        else:
            raise ValueError(f"unknown mode {mode!r}")
    return out


def alternated(plan: list[tuple[str, Callable]], repeat: int) -> list[tuple[int, str, Callable]]:
    """(pass, label, runner) for `repeat` passes over `plan`, each in the reverse order of the one before."""
    return [(k + 1, label, runner) for k in range(repeat) for label, runner in (plan if k % 2 == 0 else plan[::-1])]


def medians_of(rows: list[dict], labels: list[str]) -> dict[str, dict]:
    """Per label (in `labels`' order, once each), the median of its rows' wall time, tok/s, start-up and peak RSS,
    and the range of its wall times."""
    out = {}
    for label in dict.fromkeys(labels):
        mine = [r for r in rows if r["mode"] == label]
        if mine:
            out[label] = {k: round(statistics.median(r[k] for r in mine), 3)
                          for k in ("wall_s", "output_tok_s", "startup_s", "peak_rss_mib")}
            out[label] |= {"wall_s_range": [min(r["wall_s"] for r in mine), max(r["wall_s"] for r in mine)],
                           "runs": len(mine)}
    return out


def parsed_share(tokenizer, outputs: list[list[int]]) -> float:
    """Share of `outputs` whose text parses as JSON."""
    ok = 0
    for ids in outputs:
        try:
            json.loads(tokenizer.decode(ids, skip_special_tokens=True))
            ok += 1
        except ValueError:
            pass
    return round(ok / max(1, len(outputs)), 3)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of requests whose greedy tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / len(a)


def prefix_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of `b`'s tokens that `a` matches before each request's first difference (after it, greedy outputs
    follow different texts and are not comparable)."""
    same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q))) for p, q in zip(a, b))
    return same / max(1, sum(len(q) for q in b))


def print_report(report: dict, json_path: str | None) -> int:
    """Print a flat report one `key value` line each, and write it as JSON when asked."""
    width = max(map(len, report))
    for key, value in report.items():
        print(f"{key:<{width}}  {value}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def main(args, peers: Mapping[str, Peer] = PEERS) -> int:
    """Run each mode of `args.modes` on the workload, print the table and write the report; `peers`: the peer
    modes by name (`jitney.bench.peers.PEERS`). A peer whose child process fails gives a row of "mode", "failed"
    (the signal's name, or "error") and "reason", and no figures."""
    dtype = getattr(args, "dtype", "float32")
    # (where every mode runs in a child of its own that loads the model, this process holds its shapes alone)
    apart = not getattr(args, "in_process", True) and not args.null_executor and all(
        m.startswith("jitney") or m in peers for m in args.modes.split(","))
    model, tokenizer = load_bench_model(args, meta=apart)
    if args.null_executor:
        from jitney.bench.overhead import measure

        return print_report(measure(model, tokenizer), args.json_path)
    vocab = model.config.get_text_config().vocab_size
    # long-prompt is sized by the token budget it has to chunk across
    if getattr(args, "trace", None):
        from jitney.bench.traces import materialize, read_trace

        if any(not m.startswith("jitney") for m in args.modes.split(",")):
            raise ValueError("--trace replays through jitney's modes only (transformers' take no arrival times)")
        replay = materialize(read_trace(args.trace), vocab)
        work, args.arrivals = [(a.prompt, a.output_tokens) for a in replay], [a.arrival_s for a in replay]
        args.replay = replay  # (priorities and metadata)
        args.workload = args.trace
    elif args.workload == "long-prompt":
        work = long_prompt(vocab, args.max_batch_tokens)
    elif args.workload in ARRIVING:
        if any(not m.startswith("jitney") for m in args.modes.split(",")):
            raise ValueError(f"{args.workload} has arrival times: jitney's modes only (transformers' take none)")
        work, args.arrivals = ARRIVING[args.workload](vocab)
    elif args.workload in TAKES_TOKENIZER:
        if tokenizer is None:
            raise ValueError(f"the {args.workload} workload needs a tokenizer (its prompts are text): {args.model} has none")
        work = WORKLOADS[args.workload](tokenizer)
    else:
        work = WORKLOADS[args.workload](vocab)
    if "jitney-json" in args.modes.split(",") and tokenizer is None:
        raise ValueError(f"jitney-json holds replies to a JSON grammar, which needs a tokenizer: {args.model} has none")
    out_tokens = sum(n for _, n in work)
    print(f"workload {args.workload}: {len(work)} requests, {sum(len(p) for p, _ in work)} prompt and "
          f"{out_tokens} output tokens; torch threads {torch.get_num_threads()}; model in {dtype}")
    first_peak = matmul_peak_gflops()
    gflop, linear = workload_gflop(model, work), linear_gflop(model, work)
    from jitney.kernels import native

    print(f"C++ CPU kernels: {native.describe()}")
    print(f"fp32 matmul peak {first_peak:.0f} GFLOP/s; workload {gflop:.0f} GFLOP -> {gflop / first_peak:.1f} s at the roofline")
    # (the rate bf16 compute's linears can reach, where a mode computes in bf16: its shares read against it)
    bf16 = "jitney-bf16c" in args.modes.split(",") or dtype == "bfloat16"
    first_bf16_peak = matmul_peak_gflops(compute="bf16") if bf16 else None
    unit = native.load().bf16_unit() if bf16 and native.available() else "torch"
    if bf16:
        print(f"bf16 matmul peak ({unit}) {first_bf16_peak:.0f} GFLOP/s")
    first_read, weights = read_rate_gbps(), weight_bytes(model)
    print(f"memory read {first_read:.1f} GB/s; weights {weights / 1e6:.0f} MB -> one pass a token allows "
          f"{first_read * 1e9 / weights:.1f} tok/s on one stream")
    rows, outputs = [], {}
    plan, repeat = runs(args, peers), getattr(args, "repeat", 1)
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1 (got {repeat})")
    args.single_jitney_run = sum(label.startswith("jitney") for label, _ in plan) <= 1  # (timeline names)
    for run, label, runner in alternated(plan, repeat):
        t = time.perf_counter()
        passed = {"run": run} if repeat > 1 else {}
        try:
            outputs[label], stats, wall = runner(model, tokenizer, work, args)  # wall: first request to last token
        except PeerFailed as failed:
            rows.append({"mode": label, **passed, "failed": failed.signal or "error", "reason": failed.reason})
            print(f"  {label}: failed, {failed.reason}", flush=True)
            continue
        startup = getattr(stats, "startup_s", None)
        if startup is None:
            startup = time.perf_counter() - t - wall
        # (jitney's own tokens: a reply held to a grammar ends with its JSON; the others run to their counts)
        tokens = sum(map(len, outputs[label])) if isinstance(stats, StepStats) else out_tokens
        row = {
            "mode": label, **passed, "wall_s": round(wall, 2), "output_tok_s": round(tokens / wall, 1),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
            "startup_s": round(startup, 2),
            **({"shutdown_s": round(stats.shutdown_s, 2)} if getattr(stats, "shutdown_s", None) is not None else {}),
        }
        if getattr(stats, "peak_rss_mib", None) is not None:  # (a child's own: a peer's, or a jitney run apart)
            row["peak_rss_mib"] = stats.peak_rss_mib
        if isinstance(stats, PeerStats):
            if stats.note:
                row["note"] = stats.note
        elif isinstance(stats, StepStats):
            gaps = sorted(stats.gaps) or [0.0]
            row |= {"prefix_hit_rate": round(stats.hit / max(1, stats.query), 3), "prompt_tokens_computed": stats.prefill,
                    "steps": stats.steps, "forward_share": round(stats.forward_s / wall, 3),
                    "preemptions": stats.preemptions, "itl_p50_ms": round(1000 * gaps[len(gaps) // 2], 1),
                    "itl_p99_ms": round(1000 * gaps[int(len(gaps) * 0.99)], 1), "itl_max_ms": round(1000 * gaps[-1], 1),
                    "ttft_p50_ms": percentile_ms(stats.ttft, 0.5), "ttft_p99_ms": percentile_ms(stats.ttft, 0.99),
                    "ttft_mean_ms": mean_ms(stats.ttft),
                    "kv_unused_share": round(1 - stats.slots_used / max(1, stats.slots_allocated), 4),
                    "speculative_steps": stats.speculative_steps, "draft_tokens": stats.drafted,
                    "draft_accepted_share": round(stats.accepted / max(1, stats.drafted), 3)}
            if stats.attention_s is not None:  # (draft passes included)
                row["attention_share"] = round(stats.attention_s / wall, 3)
            # (choosing tokens from whole logits: processors, a grammar's mask, draws, logprobs)
            row["sampling_ms_per_step"] = round(1000 * stats.sampling_s / max(1, stats.steps), 2)
            row |= {"eviction": stats.eviction, "scheduler": stats.scheduler, "blocks_evicted": stats.evicted,
                    "step_shapes": stats.recorder.shapes, "step_seconds": stats.recorder.seconds,
                    "weights": stats.weights,  # (set by `run_jitney`)
                    "kv_itemsize": stats.kv_itemsize, "compute": stats.compute}
            if getattr(stats, "memory", None) is not None:  # (what the engine held, by part: `Engine.memory`)
                row["memory_mib"] = {k: round(getattr(stats.memory, k) / 2**20, 1) for k in stats.memory.__struct_fields__}
        if label.startswith("jitney-json"):
            row["output_tokens"], row["json_share"] = tokens, parsed_share(tokenizer, outputs[label])
            had = [(p, len(o)) for (p, _), o in zip(work, outputs[label])]
            row["gflop"], row["linear_gflop"] = workload_gflop(model, had), linear_gflop(model, had)
        rows.append(row)
        stop = f", {stats.shutdown_s:.1f} s to stop" if getattr(stats, "shutdown_s", None) is not None else ""
        print(f"  {label}: {wall:.1f} s (+{startup:.1f} s start-up{stop})", flush=True)
        if getattr(stats, "memory", None) is not None:
            print(f"    memory: {stats.memory.describe()}", flush=True)
    # This machine's speed drifts: probe again and take the faster reading (the roofline shares err low).
    peak = max(first_peak, matmul_peak_gflops())
    print(f"fp32 matmul peak probed again after the runs: {peak:.0f} GFLOP/s taken (first {first_peak:.0f})")
    bf16_peak = max(first_bf16_peak, matmul_peak_gflops(compute="bf16")) if bf16 else None
    if bf16:
        print(f"bf16 matmul peak ({unit}) probed again: {bf16_peak:.0f} GFLOP/s taken (first {first_bf16_peak:.0f})")
    read = max(first_read, read_rate_gbps())
    weight_limit = read * 1e9 / weights  # tok/s of one stream if every step only read its weights
    print(f"memory read probed again: {read:.1f} GB/s taken (first {first_read:.1f}) -> {weight_limit:.1f} tok/s on one stream")
    measured = [row for row in rows if "failed" not in row]  # (a failed peer's row has no figures)
    first = measured[0]["mode"] if measured else None
    base = outputs.get(first)
    for row in measured:
        # (a mode computing in bf16: its linears against the bf16 peak, the rest against fp32's)
        in_bf16 = row.get("compute") == "bf16" and bf16_peak is not None
        # (a reply held to a grammar ends early: its roofline counts the tokens it had)
        mine = row.get("linear_gflop", linear)
        roofline = row.get("gflop", gflop) / peak + (mine / bf16_peak - mine / peak if in_bf16 else 0.0)
        row["roofline_share"] = round(roofline / row["wall_s"], 3)
        if row.get("step_shapes"):
            shapes = row.pop("step_shapes")
            bound = attainable_seconds(model, shapes, peak, read, row.pop("weights"), row.pop("kv_itemsize"),
                                       bf16_peak if in_bf16 else None)
            row["attainable_share"] = round(bound / row["wall_s"], 3)
            steps, rate = prompt_step_rate(model, shapes, row.pop("step_seconds"))
            if steps:  # (against the peak its linears run at: most of a prompt step's work)
                row |= {"prompt_steps": steps, "prompt_step_gflops": round(rate, 1),
                        "prompt_step_share": round(rate / (bf16_peak if in_bf16 else peak), 3)}
        if len(work) == 1:  # one stream: bound by reading the weights each token, not by the matmuls
            row["weight_read_share"] = round(row["output_tok_s"] / weight_limit, 3)
        row["same_tokens_as_first"] = agreement(outputs[row["mode"]], base)
        row["same_prefix_as_first"] = round(prefix_agreement(outputs[row["mode"]], base), 4)
        for hf in ("hf-cb", "hf-static"):
            other = next((r for r in measured if r["mode"] == hf), None)
            if other is not None and row["mode"] != hf:
                row[f"vs_{hf}"] = round(row["output_tok_s"] / other["output_tok_s"], 2)
    w = max([14, *(len(row["mode"]) for row in rows)])  # (labels like jitney-nolookup[lru] are wider)
    print(f"\n{'mode':<{w}} {'wall s':>7} {'out tok/s':>9} {'vs hf-cb':>8} {'vs static':>9} {'roofline':>8} {'hit rate':>8} "
          f"{'prompt computed':>15} {'ITL p99 ms':>10} {'preempted':>9} {'same tokens':>11} {'peak RSS MiB':>12}")
    for row in rows:
        if "failed" in row:
            print(f"{row['mode']:<{w}} failed ({row['failed']}): {row['reason']}")
            continue
        hit = f"{row['prefix_hit_rate']:.0%}" if "prefix_hit_rate" in row else "-"
        computed = str(row.get("prompt_tokens_computed", "-"))
        itl, preempted = str(row.get("itl_p99_ms", "-")), str(row.get("preemptions", "-"))
        cb, static = (f"{row[k]:.2f}x" if k in row else "-" for k in ("vs_hf-cb", "vs_hf-static"))
        print(f"{row['mode']:<{w}} {row['wall_s']:>7.1f} {row['output_tok_s']:>9.1f} {cb:>8} {static:>9} "
              f"{row['roofline_share']:>8.0%} {hit:>8} {computed:>15} {itl:>10} {preempted:>9} "
              f"{row['same_tokens_as_first']:>11.0%} {row['peak_rss_mib']:>12}")
    for row in measured:
        if row.get("note"):
            print(f"{row['mode']}: {row['note']}")
    if any("attainable_share" in row for row in measured):
        print("share of the attainable (each step: its multiply-adds at the matmul peak or its weight and KV reads at "
              "the read rate, the longer): " + ", ".join(f"{row['mode']} {row['attainable_share']:.0%}" for row in measured
                                                          if "attainable_share" in row))
    if any("prompt_steps" in row for row in measured):
        def against(row):  # (the peak a row's linears run at)
            return f"bf16 ({unit})" if row.get("compute") == "bf16" and bf16 else "fp32"
        print("prompt steps (>= 128 query tokens, no draft), their operations over their forwards' time against the "
              "peak their linears run at: " + ", ".join(
                  f"{row['mode']} {row['prompt_steps']} steps at {row['prompt_step_gflops']:.0f} GFLOP/s, "
                  f"{row['prompt_step_share']:.0%} of the {against(row)} peak" for row in measured if "prompt_steps" in row))
    if any("attention_share" in row for row in measured):
        print("share of the wall time in attention (jitney's one-call decoder): "
              + ", ".join(f"{row['mode']} {row['attention_share']:.0%}" for row in measured if "attention_share" in row))
    for row in measured:
        if row["same_tokens_as_first"] < 1:
            print(f"{row['mode']}: {row['same_tokens_as_first']:.1%} of the requests' tokens identical to "
                  f"{first}'s, {row['same_prefix_as_first']:.1%} of the tokens before each one's first difference")
    if len(work) == 1 and measured:
        shares = ", ".join(f"{row['mode']} {row['weight_read_share']:.0%}" for row in measured)
        print("one stream, share of the fp32 weight-read limit (one token a pass over the fp32 weights; speculative "
              f"steps take several, int8 and 4-bit weights read less): {shares}")
    plain = next((row for row in measured if row["mode"] == "jitney"), None)
    for row in measured:
        if "json_share" in row:
            against = (f"; jitney (free text) {plain['output_tok_s']} tok/s, ITL p50 {plain['itl_p50_ms']} ms"
                       if plain is not None else "")
            print(f"{row['mode']}: {row['json_share']:.0%} of the replies parse as JSON; {row['output_tokens']} tokens at "
                  f"{row['output_tok_s']} tok/s, ITL p50 {row['itl_p50_ms']} ms, choosing tokens (the grammar's mask, "
                  f"processors) {row['sampling_ms_per_step']} ms a step of {row['steps']}{against}")
    for row in rows:
        if row.get("draft_tokens"):
            print(f"{row['mode']}: {row['speculative_steps']} speculative steps of {row['steps']}, "
                  f"{row['draft_accepted_share']:.0%} of {row['draft_tokens']} proposed tokens accepted")
    medians = medians_of(measured, [label for label, _ in plan]) if repeat > 1 else None
    if medians:
        print(f"medians of {repeat} alternated passes: " + "; ".join(
            f"{label} {m['wall_s']} s ({m['wall_s_range'][0]}-{m['wall_s_range'][1]}), {m['output_tok_s']} tok/s"
            for label, m in medians.items()))
    if getattr(args, "tokens_path", None):
        with open(args.tokens_path, "w") as f:
            json.dump({"dtype": dtype, "outputs": outputs}, f)
    report = {"workload": args.workload, "requests": len(work), "output_tokens": out_tokens, "dtype": dtype,
              "matmul_peak_gflops": peak, "matmul_peak_first_gflops": first_peak, "workload_gflop": gflop,
              "bf16_matmul_peak_gflops": bf16_peak, "bf16_unit": unit if bf16 else None,
              "read_gbps": read, "read_first_gbps": first_read, "weight_bytes": weights,
              "weight_read_limit_tok_s": round(weight_limit, 1), "rows": rows}
    if medians:
        report["medians"] = medians
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot_path and measured:
        from jitney.bench.plot import plot

        plot(report | {"rows": measured}, args.plot_path)  # (bars of the rows with figures)
        print(f"plot written to {args.plot_path}")
    return 0
