"""The `jitney` command: generate, bench, setup."""

from __future__ import annotations

import argparse
import importlib
import sys

import anyio


def _generate(args: argparse.Namespace) -> int:
    from jitney import Engine, EngineConfig, Request, SamplingParams

    engine = Engine.from_pretrained(args.model, config=EngineConfig(
        max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks, speculative_tokens=args.speculative_tokens,
        lookup_tokens=args.lookup_tokens, weights=args.weights, compute=args.compute,
        kv_cache_dtype=args.kv_cache_dtype, scheduler=args.scheduler, eviction=args.eviction,
        chunk_context_cost=args.chunk_context_cost, packed_cache=args.packed_cache))
    tok = engine.tokenizer
    prompt: str | list[int] = args.prompt
    if not args.raw and tok is not None and tok.chat_template:
        prompt = list(tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True)["input_ids"])
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)

    async def run() -> None:
        async with engine:
            async for token in engine.stream(Request(prompt, params)):
                sys.stdout.write(token.text)
                sys.stdout.flush()
        sys.stdout.write("\n")

    anyio.run(run)
    return 0


def _setup(args: argparse.Namespace) -> int:
    from jitney.core.models import embedded_checkpoint
    from jitney.kernels import native

    print(embedded_checkpoint())
    # built here once, so that the first engine does not wait for the compiler
    print("C++ CPU kernels:", native.describe())
    return 0


def _policy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scheduler", default="fifo", help="a registered scheduler (see `jitney plugins`)")
    parser.add_argument("--eviction", default="mru", help="a registered eviction policy (see `jitney plugins`)")
    parser.add_argument("--chunk-context-cost", type=float, default=None,
                        help="what a prompt chunk's attention adds to its count against --max-batch-tokens, per query "
                             "token and position (default: the model's own; 0: tokens only; EngineConfig.chunk_context_cost)")


def _cpu_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="tokens an int8 draft proposes per greedy decode on CPU (default 4 where it applies; 0: off)")
    parser.add_argument("--lookup-tokens", type=int, default=None,
                        help="tokens a greedy decode may guess from its own earlier tokens on CPU, where the draft does "
                             "not run (prompt lookup; default 4 where it applies; 0: off; EngineConfig.lookup_tokens)")
    parser.add_argument("--weights", default=None, choices=["int8", "w8a8", "bf16"],
                        help="int8: the linear layers through int8 copies of their weights; w8a8: their inputs rounded "
                             "to int8 too; bf16: through bf16 copies (CPU; EngineConfig.weights)")
    parser.add_argument("--compute", default=None, choices=["fp32", "bf16"],
                        help="bf16: the linear layers (not the LM head) round their rows and weights to bfloat16 and "
                             "sum in fp32, on AMX or AVX512-BF16 where the CPU has them (EngineConfig.compute)")
    parser.add_argument("--kv-cache-dtype", default=None, choices=["bf16", "int8"],
                        help="bf16: keys and values cached rounded to bfloat16, half the memory and half what decode "
                             "attention reads; int8: as int8 codes with a scale per position and head, about a quarter "
                             "(EngineConfig.kv_cache_dtype)")
    parser.add_argument("--packed-cache", action="store_true",
                        help="keep the packed weights on disk and map them on a later start instead of packing again "
                             "(EngineConfig.packed_cache)")


def _serve(args: argparse.Namespace) -> int:
    from jitney import EngineConfig

    fields = dict(max_batch_tokens=args.max_batch_tokens, num_blocks=args.num_blocks,
                  cpu_offload_space=args.cpu_offload_space, speculative_tokens=args.speculative_tokens,
                  lookup_tokens=args.lookup_tokens, weights=args.weights, compute=args.compute,
                  kv_cache_dtype=args.kv_cache_dtype, scheduler=args.scheduler, eviction=args.eviction,
                  chunk_context_cost=args.chunk_context_cost, packed_cache=args.packed_cache)
    EngineConfig(**fields)  # (a bad value is refused here, before any replica starts)
    if args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.replicas > 1 or args.address:
        if args.record_trace:
            raise ValueError("--record-trace records one engine's traffic: use it with --replicas 1")
        from jitney.core.hooks import make_plugin_manager, registry
        from jitney.routers.base import RouterConfig
        from jitney.serve.cluster import Fleet, serve_fleet

        registry(make_plugin_manager(), "router").create(args.router, RouterConfig())  # (an unknown name: here)

        fleet = Fleet(args.model, args.replicas, args.router, fields, args.api_key, args.max_waiting, args.max_n)
        serve_fleet(fleet, args.host, args.port, args.address)
        return 0
    from jitney.serve.app import serve

    serve(args.model, args.host, args.port, args.api_key, args.max_waiting, EngineConfig(**fields), max_n=args.max_n,
          record_trace=args.record_trace, record_ids=args.record_ids)
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from jitney.core.hooks import describe_plugins, make_plugin_manager

    rows = describe_plugins(make_plugin_manager())
    width = max(len(name) for _, name, _ in rows)
    for role in dict.fromkeys(role for role, _, _ in rows):
        print(f"{role}:")
        for _, name, dist in (r for r in rows if r[0] == role):
            print(f"  {name:<{width}}  {dist}")
    return 0


_TOOLS = {
    "bench": ("jitney.bench.run", "compare jitney with transformers on a workload"),
    "bench-online": ("jitney.bench.online", "Poisson arrivals of streaming clients against a server"),
    "soak": ("jitney.bench.soak", "many streaming clients against a server, some leaving mid-stream; then whether it "
                                  "came back to its baseline"),
    "simulate": ("jitney.bench.simulate", "run the real scheduler, cache and eviction plugins on a cost model of the "
                                          "forward (no weights): hit rate, throughput, TTFT, ITL (the first run "
                                          "calibrates the cost model)"),
    "calibrate": ("jitney.bench.profile", "time real steps on this machine and fit the step-time profile that "
                                          "`jitney simulate` uses (or --analytic, from hardware figures)"),
    "trace": ("jitney.bench.traces", "generate a request trace (JSONL) of a realistic shape"),
    "fidelity": ("jitney.bench.fidelity", "a simulation's figures against real runs', policy by policy: signed errors "
                                          "and Kendall's tau of the policies' rankings"),
    "quality": ("jitney.bench.quality", "perplexity on held-out text through the engine's kernels, fp32 against int8 "
                                        "weights or a bf16 KV cache, and how often their most likely tokens agree"),
}
"""Subcommands whose module has `add_arguments(parser)` and `main(args)`."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jitney", description="continuous-batching inference for HF causal LMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="stream an answer to one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2", help='a local checkpoint directory, or "smollm2" (default)')
    gen.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    gen.add_argument("--max-new-tokens", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--max-batch-tokens", type=int, default=256)
    gen.add_argument("--num-blocks", type=int, default=256)
    _cpu_arguments(gen)
    _policy_arguments(gen)
    gen.set_defaults(func=_generate)

    setup = sub.add_parser("setup", help="convert the embedded SmolLM2 once (print where it is cached) and build the C++ CPU kernels")
    setup.set_defaults(func=_setup)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server")
    srv.add_argument("--model", default="smollm2", help='a local checkpoint directory, or "smollm2" (default)')
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require `Authorization: Bearer KEY` on every endpoint but /health and /openapi.json")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="queued samples (a request counts its n) beyond this get 429 at once")
    srv.add_argument("--max-n", type=int, default=16, help="the most samples (n) one request may ask for")
    srv.add_argument("--record-trace", default=None, metavar="FILE",
                     help="append each finished request to this JSONL trace (replay: jitney simulate/bench --trace); "
                          "prompts as lengths and block hashes, no text")
    srv.add_argument("--record-ids", action="store_true", help="record the prompts' token ids in the trace too")
    srv.add_argument("--max-batch-tokens", type=int, default=256)
    srv.add_argument("--num-blocks", type=int, default=None, help="KV cache blocks (default: sized from free memory)")
    srv.add_argument("--cpu-offload-space", type=float, default=1.0, help="GiB of swap pool for preempted requests")
    srv.add_argument("--replicas", type=int, default=1,
                     help="engine replicas behind Ray Serve (needs `pip install jitney[cluster]`); 1: one engine here")
    srv.add_argument("--router", default="prefix_affinity",
                     help="how requests are placed on replicas: a registered router (see `jitney plugins`)")
    srv.add_argument("--address", default=None,
                     help="join this Ray cluster (auto, ray://host:port) instead of starting a local Ray")
    _cpu_arguments(srv)
    _policy_arguments(srv)
    srv.set_defaults(func=_serve)

    plugins = sub.add_parser("plugins", help="list every registered plugin by role, with the package providing it")
    plugins.set_defaults(func=_plugins)

    for name, (module, help_text) in _TOOLS.items():
        tool = importlib.import_module(module)
        tool.add_arguments(command := sub.add_parser(name, help=help_text))
        command.set_defaults(func=tool.main)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"jitney: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
