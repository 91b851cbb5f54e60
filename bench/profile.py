"""Step-time profiles for `jitney simulate`, and `jitney calibrate`, which fits one on this machine.

A step's time is modelled as a non-negative sum over its shape: a fixed cost, the query tokens (the linear
layers), the sampled rows (the LM head), the KV tokens decode rows read, the prefill chunks' attention work
(query tokens x context), and for a speculative step its draft's passes. `jitney calibrate` times real steps
of a grid of workloads through the engine itself, fits the coefficients, and measures how often the draft's
proposals are accepted. `jitney simulate` calibrates on first use where this machine has no profile yet."""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import anyio
import msgspec
import numpy as np
import torch

FEATURES = ("step", "query_tokens", "sampled_rows", "decode_kv_ktokens", "decode_kv_distinct_ktokens",
            "prefill_attention_mtokens2", "draft_passes", "draft_tokens", "draft_kv_ktokens", "screen_resting")
"""What a step's time is predicted from (KV tokens in thousands, prefill attention in millions of query x key
pairs). Decode rows sharing a prefix read the same blocks: those reads come from the CPU's caches, so the
distinct KV tokens read are a feature of their own. A speculative step (`FusedDecoder.speculate`) is its
draft's k passes over every row (each pass reads the int8 weights once) and one pass of the model over each
row's token and its k proposals: that pass's shape fills the first features, the draft's the three after. A step
whose rows come with prompt-lookup guesses (`FusedDecoder.check`) is that checking pass alone. `screen_resting` is 1
for a step whose greedy rows took every logit of the LM head because its screen was resting (`HeadScreen` in
`kernels/cpu/head_screen.h`: after a window of rows that mostly missed it, as the first tokens after random prompts
do), where a screened step reads a quarter of the head's bytes: 0.3-5.5 ms a step of SmolLM2's in six
calibrations on a Zen 4. A simulation takes the screen as on (it has no logits to tell a miss), as it is through a
served run of longer replies; a calibration's short replies after random prompts rest it for a quarter of their
steps."""

SPECULATIVE = FEATURES.index("draft_passes")
"""The first feature only speculative steps have."""
DRAFTED = slice(SPECULATIVE, FEATURES.index("draft_kv_ktokens") + 1)
"""The draft's features (a profile fitted without speculation has them 0, or none: an older profile's list ends
there)."""


def features(step, sampled: int, speculate: int = 0, proposals: list[list[int]] | None = None,
             resting: bool = False) -> list[float]:
    """A step's shape (`StepInputs`), in `FEATURES` order; `speculate`: the draft tokens of each row, or
    `proposals`: each row's guesses (its entries are then all one-token decodes, `sampled` of them); `resting`: its
    greedy rows take every logit, the head's screen resting."""
    query_lens, context_lens, nd = step.query_lens, step.context_lens, step.num_decodes
    decode_kv = sum(context_lens[:nd])  # (decode rows come first; a prompt's one-token chunk is not one)
    prefill_attention = sum(q * c for q, c in zip(query_lens[nd:], context_lens[nd:]))
    distinct = 0
    if step.num_decodes:  # (decode rows come first) distinct blocks they read, the padding block aside
        blocks = torch.unique(step.block_tables[0][: step.num_decodes].cpu())
        distinct = (len(blocks) - int(bool((blocks == step.padding_slot // step.block_size).any()))) * step.block_size
    if proposals:  # row j of a request's checking rows reads j tokens more than its decode would
        widths = [1 + len(p) for p in proposals]
        checked = sum(w * c + w * (w - 1) / 2 for w, c in zip(widths, context_lens[:nd]))
        return [1.0, float(sum(widths)), float(sum(widths)), checked / 1e3, distinct / 1e3, 0.0, 0.0, 0.0, 0.0, 0.0]
    if not speculate:
        return [1.0, float(sum(query_lens)), float(sampled), decode_kv / 1e3, distinct / 1e3,
                prefill_attention / 1e6, 0.0, 0.0, 0.0, float(resting)]
    rows, k = len(query_lens), speculate
    # the draft's pass j and the model's row j of each request read j tokens more than its decode would
    draft_kv = k * decode_kv + rows * k * (k - 1) / 2
    checked_kv = (k + 1) * decode_kv + rows * k * (k + 1) / 2
    return [1.0, float(rows * (k + 1)), float(rows * (k + 1)), checked_kv / 1e3, distinct / 1e3, 0.0,
            float(k), float(rows * k), draft_kv / 1e3, 0.0]


class StepProfile(msgspec.Struct, frozen=True):
    """Seconds per unit of each feature, fitted on one machine for one model."""

    model: str
    machine: str
    coefficients: list[float]
    fit_error: float
    """Mean absolute relative error of the fitted step times on the calibration steps."""
    total_error: float
    """Relative error of their sum (what a simulated wall time inherits)."""
    steps: int
    acceptance: float | None = None
    """The chance that the draft's next proposal is the model's own token, measured on the calibration's
    speculative steps (text through the chat template); None: fitted without speculation (or analytic), and
    simulations of it do not speculate."""
    calibration: int = 1
    """The `CALIBRATION` that fitted it (a profile saved before there was one reads 1; an analytic one's is moot)."""

    @property
    def speculates(self) -> bool:
        return self.acceptance is not None and len(self.coefficients) > SPECULATIVE

    def predict(self, shape: list[float]) -> float:
        return max(0.0, sum(c * x for c, x in zip(self.coefficients, shape)))

    def describe(self) -> str:
        if not self.steps:
            return f"{self.model} on {self.machine} (not fitted)"
        drafts = f", draft proposals accepted {self.acceptance:.0%}" if self.speculates else ", no speculation"
        return (f"{self.model} on {self.machine}: fit error {self.fit_error:.1%} a step, {self.total_error:+.1%} in "
                f"total, over {self.steps} steps{drafts}")


CALIBRATION = 3
"""What `calibrate` measures, by version. 2: every step with prompt lookup off, as a simulation has it (at 1 the grid's
decode steps of many rows were nearly all lookup's checking passes, priced on the same features as the plain decode
steps a simulation takes), and the screen's rests a feature of their own. 3: each workload in a fresh process. A
machine's saved profile from an earlier version is calibrated again on first use, and a new calibration replaces it
whatever their fit errors."""

MAX_FIT_ERROR = 0.10
"""A fitted profile whose mean error a step is above this is not saved: a quiet 2-core machine fits SmolLM2 within
5-7% (9.6% and 10.7% seen too); 232% was seen while another process used the cores. A 10.7% profile simulated
multi-prefix's wall time 15-21% high where a 5.3% one calibrated the same day was 3-8% high (docs/research.md). (A
workload run twice, at the start and at the end, moved +14.5% and -19.9% on a quiet machine: no finer gauge of the
machine's noise than the fit itself.)"""


def refusal(profile: StepProfile, current: StepProfile | None = None) -> str | None:
    """Why `profile` should not become this machine's profile in place of `current` (None where it should)."""
    if profile.fit_error > MAX_FIT_ERROR:
        return (f"its fit error ({profile.fit_error:.1%} a step) is above {MAX_FIT_ERROR:.0%}: the steps' times were "
                "too scattered for the cost model, usually because another process used the cores")
    if (current is not None and current.steps and current.calibration == profile.calibration
            and current.fit_error < profile.fit_error):
        return (f"the profile already saved fits better ({current.fit_error:.1%} a step against "
                f"{profile.fit_error:.1%})")
    return None


WHAT_TO_DO = "run `jitney calibrate` again on a quiet machine (nothing else on its cores), or add --force to keep it"


def fit(shapes: list[list[float]], seconds: list[float], sweeps: int = 2000,
        weights: list[float] | None = None) -> list[float]:
    """Least squares with every coefficient >= 0 (coordinate descent on the normal equations, the columns
    scaled to unit norm first): correlated features share the cost instead of one going negative. `weights`
    scale each step's error (1 / its seconds: relative errors)."""
    x, y = np.array(shapes, dtype=float), np.array(seconds, dtype=float)
    if weights is not None:
        w = np.array(weights, dtype=float)
        x, y = x * w[:, None], y * w
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    a = x / norms
    gram, target = a.T @ a, a.T @ y
    b = np.zeros(x.shape[1])
    for _ in range(sweeps):
        before = b.copy()
        for j in range(len(b)):
            if gram[j, j] > 0:
                b[j] = max(0.0, b[j] + (target[j] - gram[j] @ b) / gram[j, j])
        if np.abs(b - before).max() <= 1e-12 * max(1.0, np.abs(b).max()):
            break
    return [float(c) for c in b / norms]


def fit_in_two(shapes: list[list[float]], seconds: list[float]) -> list[float]:
    """`fit` the plain steps' features on the plain steps alone, then the draft's features on what the
    speculative steps took beyond their checking pass as those predict it: the few speculative steps then
    cannot pull the coefficients every other step depends on (fitted together, shared-prefix's wall time
    went from -3% to +11% and mixed-64's ITL from -8% to -15% against the real runs). Each step's error counts
    as a share of its time, as the fit error is reported: fitted on seconds, a 300 ms prompt chunk off by a share
    counted 225 times a 20 ms decode step off by the same share. On one calibration's steps, fitted both ways, the
    relative fit put wall time and ITL p50 a little nearer the real runs on every workload tried, no figure more
    than 0.3 points farther (docs/research.md)."""
    relative = [1 / max(y, 1e-6) for y in seconds]

    def own(shape: list[float]) -> list[float]:  # (the features every step has)
        return [*shape[: DRAFTED.start], *shape[DRAFTED.stop :]]

    plain = [i for i, s in enumerate(shapes) if not any(s[DRAFTED])]
    base = fit([own(shapes[i]) for i in plain], [seconds[i] for i in plain], weights=[relative[i] for i in plain])
    drafting = [i for i, s in enumerate(shapes) if any(s[DRAFTED])]
    draft = [0.0] * (DRAFTED.stop - DRAFTED.start)
    if drafting:
        beyond = [seconds[i] - float(np.dot(base, own(shapes[i]))) for i in drafting]
        draft = fit([shapes[i][DRAFTED] for i in drafting], beyond, weights=[relative[i] for i in drafting])
    return [*base[: DRAFTED.start], *draft, *base[DRAFTED.start :]]


def machine_tag() -> str:
    """The CPU model and core count (a profile is only valid on the machine kind it was fitted on)."""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores"


def profile_path(model: str) -> Path:
    from jitney.core.models import cache_dir

    key = hashlib.sha1(f"{model}\n{machine_tag()}".encode()).hexdigest()[:12]
    return cache_dir() / "profiles" / f"{Path(model).name or 'model'}-{key}.json"


CALIBRATION_S = 135
"""About how long `calibrate` takes for SmolLM2-135M on a 2-core CPU (said before a first-use calibration)."""


def load_profile(path: str | None, model: str) -> StepProfile:
    """The profile at `path`, else the one `jitney calibrate --model <model>` saved for this machine."""
    where = Path(path) if path else profile_path(model)
    if not where.exists():
        raise FileNotFoundError(f"no step-time profile for {model!r} on this machine ({where}): run "
                                f"`jitney calibrate --model {model}` first, or give --profile FILE")
    try:
        return msgspec.json.decode(where.read_bytes(), type=StepProfile)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{where} is not a step-time profile: {exc}") from None


def profile_for(path: str | None, model: str, calibrate_missing: bool = True) -> StepProfile:
    """`load_profile`, except that where this machine has no profile for `model` (and no `path` is given) one is
    calibrated now (`calibrate_model`, with a progress bar) and saved where `jitney calibrate` saves it: only the
    first simulation of a model on a machine waits for it. `calibrate_missing=False`: raise `FileNotFoundError`
    instead, as `load_profile` does."""
    where = profile_path(model)
    if path or not calibrate_missing:
        return load_profile(path, model)
    if where.exists():
        saved = load_profile(None, model)
        if not saved.steps or saved.calibration >= CALIBRATION or Path(model).is_file():  # (analytic; a config's)
            return saved
        print(f"the step-time profile saved for {model!r} on this machine was fitted by an earlier calibration",
              file=sys.stderr)
    if Path(model).is_file():
        raise FileNotFoundError(f"no step-time profile for {model!r} on this machine, and a config.json has no weights "
                                f"to calibrate one: give the checkpoint folder, or --profile FILE (`jitney calibrate "
                                f"--analytic` writes one from hardware figures)")
    print(f"no current step-time profile for {model!r} on this machine: calibrating it now (once; ~{CALIBRATION_S} s "
          f"for SmolLM2-135M on 2 CPU cores)", file=sys.stderr)
    profile = calibrate_model(model)
    why = refusal(profile)
    if why:
        raise ValueError(f"the calibration just run is not kept: {why}; {WHAT_TO_DO}")
    save_profile(profile, where)
    print(f"{profile.describe()}; saved to {where}", file=sys.stderr)
    return profile


def calibrate_model(model: str, progress: bool = True) -> StepProfile:
    """`calibrate` "smollm2" or the checkpoint folder `model` (its weights are run, each workload's process loading
    them itself: this one holds its architecture and tokenizer alone)."""
    from jitney.bench.simulate import meta_model
    from jitney.core.models import load_tokenizer

    return calibrate(meta_model(model), load_tokenizer(model), model, progress=progress)


def save_profile(profile: StepProfile, out: Path) -> None:
    """Write `profile` to `out`, whole or not at all: another simulation may be reading it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.{os.getpid()}")
    partial.write_bytes(msgspec.json.encode(profile))
    partial.replace(out)


class StepRecorder:
    """Wraps `StepExecutor.forward` of a real engine: each step's shape and the seconds its forward took, and of
    speculative steps' proposals, how many were accepted (those after a rejected one are never checked)."""

    def __init__(self, executor):
        self.executor, self.forward = executor, executor.forward
        self.shapes: list[list[float]] = []
        self.seconds: list[float] = []
        self.accepted = self.rejected = 0
        executor.forward = self

    def __call__(self, prepared, started):
        d = self.executor.decoder  # (the one-call decoder's screen rests through whole greedy steps)
        resting = (d is not None and d.screened and d.native.screen_rest[0] > 0 and bool(prepared.sampled_entries)
                   and all(s.greedy for s in prepared.params))
        t = time.perf_counter()
        result = self.forward(prepared, started)
        self.seconds.append(time.perf_counter() - t)
        self.shapes.append(features(prepared.step, len(prepared.params), prepared.speculate, prepared.proposals,
                                    resting))
        for i in prepared.sampled_entries if prepared.speculate or prepared.proposals else ():
            taken = len(result[i]) - 1
            offered = len(prepared.proposals[i]) if prepared.proposals else prepared.speculate
            self.accepted += taken
            self.rejected += taken < offered
        return result


def calibration_workloads(vocab: int) -> list[list[tuple[list[int], int]]]:
    """A grid of step shapes: few and many decode rows at short and long contexts, prefill chunks of every size,
    and mixed steps."""
    import random

    rng = random.Random(99)

    def requests(count: int, prompt: tuple[int, int], new: int):
        return [([rng.randrange(100, vocab) for _ in range(rng.randint(*prompt))], new) for _ in range(count)]

    shared = [rng.randrange(100, vocab) for _ in range(480)]
    sharing = [(shared + [rng.randrange(100, vocab) for _ in range(rng.randint(8, 40))], 24) for _ in range(48)]
    return [requests(1, (16, 16), 48), requests(4, (200, 400), 48), requests(16, (32, 128), 40),
            requests(64, (16, 256), 24), requests(64, (300, 600), 12), requests(4, (900, 1500), 8), sharing]


def calibrate(model, tokenizer, model_name: str, progress: bool = False, **config_fields) -> StepProfile:
    """Time real steps of `calibration_workloads` through the engine (no speculation), and of chat requests
    with the engine's own speculation where it speculates, all without prompt lookup (`CALIBRATION`), and fit a
    profile. `progress`: a bar of the requests' tokens (prompt and output) served. `model`: its architecture (a
    meta model will do): each workload's engine runs in a fresh process that loads `model_name` itself, as `jitney
    bench` runs each of jitney's runs: engines after the first in one process decoded 4 rows 13-23% slower (a median
    of 20.8-22.6 ms a step against the first's 18.4, eight engines one after another; Zen 4, SmolLM2), so a
    calibration in one process priced decode steps above a served run's."""
    from tqdm import tqdm

    from jitney.bench.isolation import run_in_child
    from jitney.bench.workloads import chat

    shapes, seconds = [], []
    accepted = rejected = 0
    vocab = model.config.get_text_config().vocab_size
    plan = [(work, 0) for work in calibration_workloads(vocab)]
    if tokenizer is not None:  # (speculative_tokens None: the engine's default, where it speculates)
        plan += [(chat(tokenizer, 1), None), (chat(tokenizer, 4), None)]

    bar = tqdm(total=sum(len(p) + n for work, _ in plan for p, n in work), desc="calibrating", unit="tok",
               disable=not progress, leave=False)
    for work, speculate in plan:
        timed, _ = run_in_child(time_workload, None, None, model_name, work, speculate, config_fields)
        shapes, seconds = shapes + timed[0], seconds + timed[1]
        accepted, rejected = accepted + timed[2], rejected + timed[3]
        bar.update(sum(len(p) + n for p, n in work))
    bar.close()
    coefficients = fit_in_two(shapes, seconds)
    # Each proposal accepted with one chance p, independently: p's maximum-likelihood estimate over the rows
    # seen is accepted / (accepted + rejections), a row's run ending at its first rejection or at k.
    predicted = [max(0.0, float(np.dot(coefficients, s))) for s in shapes]
    errors = [abs(p - y) / y for p, y in zip(predicted, seconds) if y > 0]
    return StepProfile(model=model_name, machine=machine_tag(), coefficients=coefficients, calibration=CALIBRATION,
                       fit_error=round(sum(errors) / len(errors), 4),
                       total_error=round(sum(predicted) / sum(seconds) - 1, 4), steps=len(shapes),
                       acceptance=round(accepted / (accepted + rejected), 4) if accepted + rejected else None)


def time_workload(model, tokenizer, model_name: str, work: list[tuple[list[int], int]], speculate: int | None,
                  config_fields: dict) -> tuple[list[list[float]], list[float], int, int]:
    """One calibration workload through an engine of its own: each step's shape and seconds (the first step aside:
    it pays for warming up), and the draft's proposals accepted and rejected. `model` None: `model_name` loaded
    here (in a child process)."""
    from jitney import Engine, EngineConfig, Request, SamplingParams

    if model is None:
        from transformers.utils import logging as transformers_logging

        from jitney.core.models import load_model

        transformers_logging.disable_progress_bar()  # (a child's loading bar would cut across the calibration's)
        model, tokenizer = load_model(model_name)
    blocks = sum(-(-(len(p) + n) // 16) for p, n in work) + 8
    config = EngineConfig(**{"num_blocks": blocks, "speculative_tokens": speculate, "lookup_tokens": 0,
                             "max_requests_per_batch": max(64, len(work)), **config_fields})
    engine = Engine(model, tokenizer, config)
    recorder = StepRecorder(engine.executor)

    async def main() -> None:
        async with engine, anyio.create_task_group() as tg:
            for prompt, n in work:
                tg.start_soon(engine.generate, Request(prompt, SamplingParams(max_new_tokens=n, ignore_eos=True)))

    anyio.run(main)
    return recorder.shapes[1:], recorder.seconds[1:], recorder.accepted, recorder.rejected


def host_overhead(model) -> tuple[float, float]:
    """The engine's own time per step on this machine, its forward costing nothing (`bench/overhead.py`:
    scheduler, cache manager, building the step's inputs, the forward thread's hop, the bus), at 1, 16 and 128
    decoding requests: (seconds a step, seconds more a decode row). `model`: any (meta) model."""
    from jitney.bench.overhead import measure

    one, small, large = (measure(model, None, requests=n, new_tokens=48, check_model=False, speculative_tokens=0)
                         ["step_ms_mean"] / 1000 for n in (1, 16, 128))
    per_row = max(0.0, (large - small) / (128 - 16))
    # A step's own cost from one request, not extrapolated back from 16: on a busy machine the 16 -> 128 slope
    # is noisy, and 16 rows of it could exceed the step's whole time (a measured 0 overhead).
    return max(0.0, one - per_row), per_row


def analytic(model, tflops: float, gbps: float, dtype_bytes: int = 2, name: str = "model",
             step_overhead_s: float = 0.0, row_overhead_s: float = 0.0) -> StepProfile:
    """A profile for hardware you do not have, from its peak matmul rate (TFLOP/s) and memory bandwidth (GB/s):
    a step reads every weight once; each query token costs 2 FLOPs a weight (the LM head only for sampled rows);
    a decode row reads its KV; prefill attention costs 4 FLOPs per layer, head, head dimension and query x key
    pair. Compute and memory are added, not overlapped: an upper bound for the device's own work. The host's
    time is added to it: `step_overhead_s` a step and `row_overhead_s` a sampled row (`host_overhead` measures
    the engine's own; kernel launches are not in it). `model`: any (meta) model."""
    mc = model.config.get_text_config()
    heads = mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    params = sum(p.numel() for p in model.parameters())
    head = mc.hidden_size * mc.vocab_size  # the LM head (tied or not, computed for sampled rows only)
    per_token = 2 * (params - 2 * head if not getattr(mc, "tie_word_embeddings", False) else params - head)
    flop_s, byte_s = tflops * 1e12, gbps * 1e9
    kv_per_token = 2 * mc.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    coefficients = [params * dtype_bytes / byte_s + step_overhead_s, max(0, per_token) / flop_s,
                    2 * head / flop_s + row_overhead_s, kv_per_token * 1e3 / byte_s, 0.0,
                    4 * mc.num_hidden_layers * heads * head_dim * 1e6 / flop_s]
    return StepProfile(model=name, machine=f"analytic: {tflops:g} TFLOP/s, {gbps:g} GB/s, {dtype_bytes}-byte weights",
                       coefficients=coefficients, fit_error=0.0, total_error=0.0, steps=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help='"smollm2" or a checkpoint folder (a config.json with --analytic)')
    parser.add_argument("--out", default=None, help="where to write the profile (default: the jitney cache)")
    parser.add_argument("--analytic", action="store_true",
                        help="no timing: a profile from --tflops and --gbps (hardware you do not have; needs --out)")
    parser.add_argument("--tflops", type=float, default=None, help="peak dense matmul TFLOP/s at the weights' type")
    parser.add_argument("--gbps", type=float, default=None, help="memory bandwidth, GB/s")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes a weight and a KV value (2: bf16)")
    parser.add_argument("--force", action="store_true",
                        help="save the profile even where its fit is poor or the one saved fits better")
    parser.add_argument("--step-overhead-ms", type=float, default=None,
                        help="host time a step adds (launches, Python); default: the engine's own, measured here "
                             "with a forward that costs nothing (kernel launches not included)")


def main(args: argparse.Namespace) -> int:
    if args.analytic:
        from jitney.bench.simulate import meta_model

        if not (args.tflops and args.tflops > 0 and args.gbps and args.gbps > 0 and args.out):
            raise ValueError("--analytic needs --tflops > 0, --gbps > 0 and --out FILE")
        if args.step_overhead_ms is not None and args.step_overhead_ms < 0:
            raise ValueError("--step-overhead-ms must be >= 0")
        model = meta_model(args.model)
        if args.step_overhead_ms is None:
            step_s, row_s = host_overhead(model)
            print(f"the engine's own time on this machine: {step_s * 1e3:.2f} ms a step + {row_s * 1e6:.1f} µs a row "
                  f"(give --step-overhead-ms to use another figure)")
        else:
            step_s, row_s = args.step_overhead_ms / 1000, 0.0
        profile = analytic(model, args.tflops, args.gbps, args.dtype_bytes, args.model, step_s, row_s)
        Path(args.out).write_bytes(msgspec.json.encode(profile))
        print(f"{profile.describe()}; written to {args.out}")
        return 0
    t = time.perf_counter()
    profile = calibrate_model(args.model)
    out = Path(args.out) if args.out else profile_path(args.model)
    print(f"{profile.describe()} ({time.perf_counter() - t:.0f} s)")
    print("seconds per unit: " + ", ".join(f"{n} {c:.3g}" for n, c in zip(FEATURES, profile.coefficients)))
    current = None
    if out.exists():
        try:
            current = msgspec.json.decode(out.read_bytes(), type=StepProfile)
        except msgspec.DecodeError:
            pass  # (not a profile: replaced)
    why = refusal(profile, current)
    if why and not args.force:
        print(f"not written to {out}: {why}; {WHAT_TO_DO}", file=sys.stderr)
        return 1
    if why:
        print(f"written anyway (--force), though {why}", file=sys.stderr)
    save_profile(profile, out)
    print(f"written to {out}")
    return 0
