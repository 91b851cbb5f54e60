"""`jitney simulate`: the engine's own scheduler, cache manager, prefix cache, eviction, preemption and event bus
— the very plugin code that serves — driven by a cost model instead of the model: each step's time is
predicted from its shape by a profile (`jitney calibrate`, which the first simulation of a model on a machine
runs) and added to a virtual clock; tokens are produced without a forward. A simulation needs only the model's
config, never its weights (the model is built on torch's meta device, and so is the KV cache); a calibration
runs the real model."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import random
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
import torch

from jitney.bench.profile import SPECULATIVE, StepProfile, features, profile_for
from jitney.bench.stats import StepStats, mean_ms, percentile_ms
from jitney.bench.workloads import WORKLOADS
from jitney.core import events as ev
from jitney.core.hooks import hookimpl

SIM_TOKEN = 7
"""The token every simulated sample draws (workloads run with `ignore_eos`, so only their lengths matter)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help='"smollm2", a checkpoint folder or a config.json (weights unused)')
    parser.add_argument("--workload", default="multi-prefix", choices=sorted(WORKLOADS),
                        help="the chat ones need the model's tokenizer (a checkpoint folder, or smollm2)")
    parser.add_argument("--trace", default=None, help="a JSONL trace to replay instead (see `jitney trace`)")
    parser.add_argument("--scheduler", default="fifo", help="comma-separated schedulers: one run per (scheduler, eviction)")
    parser.add_argument("--eviction", default="mru", help="comma-separated eviction policies")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="cache size, of each replica (default: the whole workload fits)")
    parser.add_argument("--cache-share", type=float, default=None, help="cache size as a share of what the workload needs")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-batch-tokens", type=int, default=256)
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="draft tokens a decode may get, as `EngineConfig.speculative_tokens` (simulated where the "
                             "profile was calibrated with speculation)")
    parser.add_argument("--acceptance", type=float, default=None,
                        help="chance that a draft proposal is accepted (default: the profile's, measured on chat text)")
    parser.add_argument("--profile", default=None,
                        help="a profile file (default: this machine's, from `jitney calibrate`, which the first "
                             "simulation of a model runs)")
    parser.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                        help="where this machine has no profile for the model, stop with an error instead of "
                             "calibrating one")
    parser.add_argument("--seeds", type=int, default=1,
                        help="simulate each policy this many times, each with its own seeded step-time noise (rows "
                             "carry `seed`): a distribution to set beside real runs, whose steps vary")
    parser.add_argument("--jitter", type=float, default=None,
                        help="spread of a step's time about its prediction, as a share (default: the profile's fit "
                             "error a step where --seeds > 1, else 0: a single simulation repeats exactly)")
    parser.add_argument("--json", dest="json_path", default=None, help="also write the rows to this file")
    parser.add_argument("--replicas", type=int, default=1, help="a fleet of engines, as `jitney serve --replicas`")
    parser.add_argument("--router", default="prefix_affinity",
                        help="comma-separated routers placing requests on the replicas (one run each)")
    parser.add_argument("--timeline", default=None, metavar="FILE.png",
                        help="draw each run's schedule (one file per (scheduler, eviction) pair when several)")
    parser.add_argument("--timeline-axis", default="step", choices=["step", "time"],
                        help="the timeline's x-axis: steps, or (simulated) seconds")


@dataclass
class Arrival:
    """One request of a simulated workload."""

    prompt: list[int]
    output_tokens: int
    arrival_s: float = 0.0
    priority: int = 0
    metadata: dict | None = None


class VirtualClock:
    """The engine's clock in a simulation: moved only by the steps' predicted times (and idle jumps)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedForward:
    """Stands in for `StepExecutor.forward`: the step's predicted time is added to the clock and every sampled
    entry draws `SIM_TOKEN`. A speculative step's row takes each of its k proposals with the profile's
    `acceptance` chance, up to its first rejection (a seeded draw: a simulation repeats exactly). With `jitter`
    > 0, each step's time is the prediction times a log-normal draw of mean 1 and spread `jitter` (seeded apart
    from the acceptance draws), as a real step's time varies about its shape's."""

    def __init__(self, executor, profile: StepProfile, clock: VirtualClock, seed: int = 0, jitter: float = 0.0):
        self.executor, self.profile, self.clock = executor, profile, clock
        self.steps = 0
        self.rng = random.Random(seed)
        self.jitter, self.noise = jitter, random.Random(f"step times {seed}")

    def __call__(self, prepared, started):
        started()
        k = prepared.speculate
        seconds = self.profile.predict(features(prepared.step, len(prepared.params), k))
        if self.jitter:
            seconds *= math.exp(self.noise.gauss(-self.jitter ** 2 / 2, self.jitter))
        self.clock.now += seconds
        self.executor.forward_s = seconds
        self.executor.row_errors, self.executor.row_logprobs = {}, {}
        self.steps += 1
        result = [None] * prepared.num_entries
        for i, count in zip(prepared.sampled_entries, prepared.samples_per_entry):
            result[i] = [SIM_TOKEN] * (count + (self._accepted(k) if k else 0))
        return result

    def _accepted(self, k: int) -> int:
        taken = 0
        while taken < k and self.rng.random() < self.profile.acceptance:
            taken += 1
        return taken


class SimulatedDecoder:
    """Stands in for the CPU's one-call decoder where the profile was calibrated with it: the engine then
    plans speculative steps as it does there (`Engine._plan_speculation`), and `SimulatedForward` runs them."""

    draft = None

    @staticmethod
    def draft_bytes() -> int:
        return 0  # (a simulated draft takes no memory)


class InlineForward:
    """Stands in for the engine's `ForwardThread` once entered: a simulated step costs microseconds, so it runs
    on the event loop's thread, not behind a thread hop (~0.2 ms a step); `wait` still yields once, so that
    arrivals are submitted between steps. In a fleet, an engine whose clock has passed the `horizon` (the next
    arrival) waits there for the others. The engine's own thread is shut down with it."""

    def __init__(self, thread, clock: VirtualClock | None = None, horizon: list[float] | None = None):
        self.thread, self.executor, self.pool = thread, thread.executor, self
        self.clock, self.horizon = clock, horizon

    def submit(self, prepared_or_fn, *args) -> Future:
        """A step run now (or, as the forward thread's pool, any function)."""
        done: Future = Future()
        if args or callable(prepared_or_fn):
            done.set_result(prepared_or_fn(*args))
        else:
            tokens = self.executor.forward(prepared_or_fn, started=lambda: None)
            done.set_result((tokens, self.executor.forward_s, self.executor.row_errors, self.executor.row_logprobs))
        return done

    def then(self, running, prepared, rows) -> None:
        return None  # (the engine then submits the step itself)

    async def wait(self, done: Future):
        await anyio.lowlevel.checkpoint()
        while self.horizon is not None and self.clock.now > self.horizon[0]:
            await anyio.sleep(0)
        return done.result()

    def shutdown(self) -> None:
        self.thread.shutdown()


class Timeline(StepStats):
    """What a simulated run's requests saw, from their events (virtual times): `StepStats`' sums, the gaps
    between each request's tokens, and time to first token per tenant."""

    def __init__(self, replicas: int = 1) -> None:
        super().__init__(slots=False)
        self.refused = 0
        self.placed = [0] * replicas  # requests each engine of a fleet was given
        self.generated = 0
        self.tenant_of: dict[str, str] = {}  # request id -> metadata["tenant"], where given
        self.ttft_by_tenant: dict[str, list[float]] = {}
        self._last: dict[str, float] = {}

    @hookimpl
    def jitney_on_events(self, events, engine):
        super().jitney_on_events(events, engine)
        for e in events:
            if isinstance(e, ev.TokensGenerated):
                self.generated += e.tokens
                last = self._last.get(e.request_id)
                if last is not None:
                    self.gaps.append(e.t - last)
                self._last[e.request_id] = e.t
            elif isinstance(e, ev.FirstToken) and e.request_id in self.tenant_of:
                self.ttft_by_tenant.setdefault(self.tenant_of[e.request_id], []).append(e.ttft)
            elif isinstance(e, ev.RequestFinished):
                self._last.pop(e.request_id, None)


def _twin(model):
    """Another meta model of `model`'s architecture (an engine serves one model object)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model.config).eval()


def meta_model(source: str):
    """The model's architecture with no weights (torch's meta device), from "smollm2", a checkpoint folder or a
    config.json."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if source == "smollm2":
        from jitney.core.models import embedded_checkpoint

        source = str(embedded_checkpoint())
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"no model config at {source!r}: give \"smollm2\", a checkpoint folder or a config.json")
    config = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def tokenizer(source: str):
    """The tokenizer of "smollm2" or a checkpoint folder (what the chat workloads' prompts are made with)."""
    from jitney.core.models import load_tokenizer

    path = Path(source)
    found = load_tokenizer(path.parent if path.is_file() else source)
    if found is None:
        raise ValueError(f"the chat workloads need the model's tokenizer, and {source!r} has none")
    return found


async def _drive(engines: list, clocks: list[VirtualClock], work: list[Arrival], timeline: Timeline,
                 router=None, horizon: list[float] | None = None) -> float:
    """Submit each request when the virtual clocks reach its arrival (an idle engine's clock jumps there), to
    the engine `router` chooses (`jitney.routers`) when there are several; returns the simulated wall time from
    the trace's time zero to the last token."""
    from tqdm import tqdm

    from jitney import Request, SamplingParams
    from jitney.routers.base import ReplicaLoad, RoutedRequest

    def busy(engine) -> bool:
        return bool(engine.waiting or engine.active or engine.preempter.offloaded)

    order = sorted(range(len(work)), key=lambda i: work[i].arrival_s)
    for clock in clocks:
        clock.now = 0.0  # (the trace's time zero, as a real replay counts it)
    horizon = horizon if horizon is not None else [0.0]
    for i in tqdm(order, desc="simulating", unit="req", disable=len(order) < 2000, leave=False):
        item = work[i]
        horizon[0] = item.arrival_s
        while any(busy(e) and c.now < item.arrival_s for e, c in zip(engines, clocks)):
            await anyio.sleep(0)  # steps go on
        for engine, clock in zip(engines, clocks):
            if not busy(engine):
                clock.now = max(clock.now, item.arrival_s)  # nothing runs until then
        engine = engines[0]
        if router is not None:
            loads = [ReplicaLoad(str(k), len(e.active), len(e.waiting), len(e.requests)) for k, e in enumerate(engines)]
            routed = RoutedRequest.of(f"r{i}", item.prompt, engine.cache.block_size, item.metadata)
            engine = engines[int(router.choose(routed, loads))]
        params = SamplingParams(max_new_tokens=item.output_tokens, ignore_eos=True)
        try:  # (submitted without a stream: nobody reads the tokens, the engine runs on regardless)
            first = engine.submit(Request(item.prompt, params, priority=item.priority, metadata=item.metadata)).samples[0]
        except ValueError:  # past the model's context or the whole cache: what a server answers 400
            timeline.refused += 1
            continue
        first.t_queued = item.arrival_s  # (it arrived then, whatever step was running)
        timeline.placed[engines.index(engine)] += 1
        if item.metadata and "tenant" in item.metadata:
            timeline.tenant_of[first.request_id] = str(item.metadata["tenant"])
    horizon[0] = math.inf
    while any(e.requests for e in engines):
        await anyio.sleep(0)
    return max(clock.now for clock in clocks)


def simulate(model, work: list[Arrival], profile: StepProfile, plugins=(), timeline_path: str | None = None,
             replicas: int = 1, router: str | None = None, timeline_axis: str = "step", seed: int = 0,
             jitter: float = 0.0, **config_fields) -> dict:
    """One simulated run of `work`: a `jitney bench`-style row (and its schedule drawn to `timeline_path`).
    With `replicas` > 1, a fleet of engines (each on its own clock, as replicas run side by side) behind the
    registered router `router`, as `jitney serve --replicas` places requests. `seed` seeds the run's draws
    (draft acceptance, and step times where `jitter` > 0: `SimulatedForward`)."""
    from jitney import Engine, EngineConfig
    from jitney.core.hooks import make_plugin_manager, registry
    from jitney.plugins.timeline import ScheduleTimeline
    from jitney.routers.base import RouterConfig

    if timeline_path and replicas > 1:
        raise ValueError("--timeline draws one engine's schedule: simulate a fleet without it")
    timeline = Timeline(replicas)
    if timeline_path:
        plugins = [*plugins, schedule := ScheduleTimeline()]
    # (prompt lookup is not simulated: which guesses the model takes depends on its tokens, which a simulation has not)
    config = EngineConfig(**{"check_model": False, "lookup_tokens": 0, **config_fields})
    router = router or "prefix_affinity"
    placing = None
    if replicas > 1:
        placing = registry(make_plugin_manager(), "router").create(router, RouterConfig(block_size=config.block_size))
    clocks = [VirtualClock() for _ in range(replicas)]
    engines, forwards = [], []
    for k, clock in enumerate(clocks):  # (one model object per engine: the meta model is built again)
        engine = Engine(model if k == 0 else _twin(model), None, config, plugins=[timeline, *plugins], clock=clock)
        forwards.append(SimulatedForward(engine.executor, profile, clock, seed=seed * 1_000_003 + k, jitter=jitter))
        engine.executor.forward = forwards[-1]
        engine.executor.device = torch.device("cpu")  # the steps' inputs are read by the cost model, not on meta
        if profile.speculates:
            engine.executor.decoder = SimulatedDecoder()
        engines.append(engine)

    ran = [0.0]
    horizon = [0.0] if replicas > 1 else None

    async def main() -> float:
        async with contextlib.AsyncExitStack() as stack:
            for engine, clock in zip(engines, clocks):
                await stack.enter_async_context(engine)
                engine._forward = InlineForward(engine._forward, clock, horizon)
            t = time.perf_counter()
            wall = await _drive(engines, clocks, work, timeline, placing, horizon)
            ran[0] = time.perf_counter() - t  # (like a real run's wall time: from the first request, start-up aside)
            return wall

    wall = anyio.run(main)
    if timeline_path:
        schedule.draw(timeline_path, f"simulated: {config.scheduler} / {config.eviction}, {len(work)} requests",
                      axis=timeline_axis)
    out_tokens = timeline.generated
    tenants = {name: {"requests": len(v), "ttft_p50_ms": percentile_ms(v, 0.5), "ttft_p99_ms": percentile_ms(v, 0.99)}
               for name, v in sorted(timeline.ttft_by_tenant.items())}
    fleet = {"replicas": replicas, "router": router, "requests_per_replica": timeline.placed} if replicas > 1 else {}
    name = f"{config.scheduler}/{config.eviction}" + (f" x{replicas} {fleet['router']}" if fleet else "")
    return {
        "mode": f"sim[{name}]", "scheduler": config.scheduler, "eviction": config.eviction, **fleet,
        "seed": seed, "jitter": round(jitter, 4),
        "wall_s": round(wall, 2), "output_tok_s": round(out_tokens / wall, 1) if wall > 0 else math.inf,
        "prefix_hit_rate": round(timeline.hit / max(1, timeline.query), 3), "prompt_tokens_computed": timeline.prefill,
        "steps": sum(f.steps for f in forwards), "preemptions": timeline.preemptions, "refused": timeline.refused,
        "blocks_evicted": timeline.evicted,
        "ttft_p50_ms": percentile_ms(timeline.ttft, 0.5), "ttft_p99_ms": percentile_ms(timeline.ttft, 0.99),
        "ttft_mean_ms": mean_ms(timeline.ttft),
        "itl_p50_ms": percentile_ms(timeline.gaps, 0.5), "itl_p99_ms": percentile_ms(timeline.gaps, 0.99),
        "speculative_steps": timeline.speculative_steps, "draft_tokens": timeline.drafted,
        "draft_accepted_share": round(timeline.accepted / max(1, timeline.drafted), 3),
        **({"tenants": tenants} if tenants else {}),
        "simulated_in_s": round(ran[0], 3),
    }


def main(args: argparse.Namespace) -> int:
    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    model = meta_model(args.model)
    profile = profile_for(args.profile, args.model, calibrate_missing=args.calibrate)
    if args.acceptance is not None:
        if not (0 <= args.acceptance <= 1 and len(profile.coefficients) > SPECULATIVE):
            raise ValueError("--acceptance must be within [0, 1], with a profile calibrated with speculation")
        profile = msgspec.structs.replace(profile, acceptance=args.acceptance)
    vocab = model.config.get_text_config().vocab_size
    if args.trace:
        from jitney.bench.traces import materialize, read_trace

        work = materialize(read_trace(args.trace), vocab)
    elif "chat" in args.workload:
        work = [Arrival(p, n) for p, n in WORKLOADS[args.workload](tokenizer(args.model))]
    else:
        work = [Arrival(p, n) for p, n in (WORKLOADS[args.workload](vocab) if args.workload != "long-prompt"
                                           else WORKLOADS[args.workload](vocab, args.max_batch_tokens))]
    need = sum(-(-(len(a.prompt) + a.output_tokens) // args.block_size) for a in work)
    num_blocks = args.num_blocks or (int(need * args.cache_share) if args.cache_share else need)
    name = args.trace or args.workload
    jitter = args.jitter if args.jitter is not None else profile.fit_error if args.seeds > 1 else 0.0
    if not 0 <= jitter < 1:
        raise ValueError("--jitter must be within [0, 1)")
    noise = f"; {args.seeds} seeds, step times spread {jitter:.1%}" if args.seeds > 1 or jitter else ""
    print(f"{name}: {len(work)} requests; cache {num_blocks} blocks; profile {profile.describe()}{noise}")
    rows = []
    routers = args.router.split(",") if args.replicas > 1 else [None]
    runs = [(s, e, r) for s in args.scheduler.split(",") for e in args.eviction.split(",") for r in routers]
    for (scheduler, eviction, router), seed in itertools.product(runs, range(args.seeds)):
        t = time.perf_counter()
        picture = args.timeline if seed == 0 else None  # (the first seed's schedule drawn)
        if picture and len(runs) > 1:
            picture = str(Path(picture).with_name(f"{Path(picture).stem}-{scheduler}-{eviction}{Path(picture).suffix}"))
        row = simulate(model, work, profile, timeline_path=picture, timeline_axis=args.timeline_axis,
                       replicas=args.replicas, router=router, seed=seed, jitter=jitter,
                       scheduler=scheduler, eviction=eviction, num_blocks=num_blocks, block_size=args.block_size,
                       max_batch_tokens=args.max_batch_tokens, max_requests_per_batch=max(64, len(work)),
                       speculative_tokens=args.speculative_tokens)
        row["with_startup_s"] = round(time.perf_counter() - t, 2)
        rows.append(row)
        label = row["mode"] + (f" seed {seed}" if args.seeds > 1 else "")
        print(f"  {label}: {row['wall_s']} s simulated, hit rate {row['prefix_hit_rate']:.0%}, "
              f"{row['blocks_evicted']} cached blocks evicted, "
              f"TTFT p50 {row['ttft_p50_ms']} ms, ITL p50 {row['itl_p50_ms']} ms ({row['simulated_in_s']} s to run, "
              f"{row['with_startup_s']} s with start-up)")
        if "requests_per_replica" in row:
            print(f"      requests per replica: {row['requests_per_replica']}")
        for tenant, t in row.get("tenants", {}).items():
            print(f"      tenant {tenant}: {t['requests']} requests, TTFT p50 {t['ttft_p50_ms']} ms, p99 {t['ttft_p99_ms']} ms")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"workload": name, "rows": rows}, indent=2))
    return 0
