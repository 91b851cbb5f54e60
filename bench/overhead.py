"""The engine's own cost per step, without the model: scheduler, cache manager, step preparation and the bus."""

from __future__ import annotations

import time

import anyio

from jitney.core.events import StepCompleted
from jitney.core.hooks import hookimpl


class NullForward:
    """Stands in for `StepExecutor.forward`: every sampled entry draws token 7 at once."""

    def __init__(self, executor):
        self.executor = executor

    def __call__(self, prepared, started):
        self.executor.zero_new_blocks(prepared)  # cache work that the real forward does first
        started()
        self.executor.forward_s = 0.0
        result = [None] * prepared.num_entries
        for i, count in zip(prepared.sampled_entries, prepared.samples_per_entry):
            result[i] = [7] * count
        return result


class StepTimes:
    """Keeps each step's `StepCompleted`: the last event of the batch a step publishes. (Looking only there
    keeps this observer's own cost, which the bus phase includes, out of the engine's figures.)"""

    def __init__(self):
        self.steps: list[StepCompleted] = []

    @hookimpl
    def jitney_on_events(self, events, engine):
        if isinstance(events[-1], StepCompleted):
            self.steps.append(events[-1])


PHASES = ("schedule", "prepare", "apply", "wake", "publish")
"""The engine's own work in a step: the scheduler with its cache reservations; building the step's input
tensors; taking the sampled tokens in (cache bookkeeping, events, tokens into the streams), and within it
waking the streams' consumers; the bus."""


class PhaseTimes:
    """Wraps the engine's methods for each phase and adds up their time per step: a step ends when the events
    published include its `StepCompleted`."""

    def __init__(self, engine):
        self.engine = engine
        self.steps: list[dict[str, float]] = []
        self.current = dict.fromkeys(PHASES, 0.0)
        for phase, owner, name in (("schedule", engine, "_schedule"), ("prepare", engine.executor, "prepare"),
                                   ("apply", engine, "_apply"), ("wake", engine, "_wake_streams"),
                                   ("publish", engine, "_flush_events")):
            setattr(owner, name, self._timed(phase, getattr(owner, name)))

    def _timed(self, phase: str, fn):
        def timed(*args, **kwargs):
            ends_step = phase == "publish" and any(isinstance(e, StepCompleted) for e in self.engine.events)
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - t
                if ends_step:
                    self.steps.append(self.current)
                    self.current = dict.fromkeys(PHASES, 0.0)
        return timed


def measure(model, tokenizer, requests: int = 256, prompt_len: int = 64, new_tokens: int = 200, block_size: int = 16,
            **config_fields) -> dict:
    """Run `requests` requests through the engine with the model replaced by `NullForward`; per-step times
    once every request is decoding. Prompts are `prompt_len` plus 0 to `block_size` - 1 tokens, so that, as
    in real traffic, a sixteenth of the requests starts a new block at every step (with equal prompts all of
    them would, together, every sixteenth step, and the median step would see none). `model` may live on
    torch's meta device (a config alone: the steps' inputs are then built on the CPU)."""
    import torch

    from jitney import Engine, EngineConfig, Request, SamplingParams

    longest = prompt_len + block_size - 1
    blocks = requests * -(-(longest + new_tokens) // block_size)
    config = EngineConfig(**{"num_blocks": blocks, "block_size": block_size, "max_batch_tokens": requests * longest,
                             "chunk_context_cost": 0.0, "max_requests_per_batch": requests, **config_fields})
    times = StepTimes()
    engine = Engine(model, tokenizer, config, plugins=[times])
    engine.executor.forward = NullForward(engine.executor)
    if engine.executor.device.type == "meta":
        engine.executor.device = torch.device("cpu")
    phases = PhaseTimes(engine)

    async def main() -> None:
        async with engine, anyio.create_task_group() as tg:
            for i in range(requests):
                prompt = [100 + i % 50] * (prompt_len + i % block_size)
                tg.start_soon(engine.generate, Request(prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))

    t = time.perf_counter()
    anyio.run(main)
    wall = time.perf_counter() - t
    full = [i for i, s in enumerate(times.steps) if s.requests == requests and s.prefill_tokens == 0]
    per_step = sorted(times.steps[i].step_s for i in full)
    report = {
        "requests": requests, "steps": len(times.steps), "full_decode_steps": len(full),
        "step_ms_p50": round(1000 * per_step[len(per_step) // 2], 3),
        "step_ms_mean": round(1000 * sum(per_step) / len(per_step), 3),
        "wall_per_step_ms": round(1000 * wall / len(times.steps), 3),
    }
    own = [phases.steps[i] for i in full]  # one entry per step, in step order
    for phase in PHASES:
        report[f"{phase}_ms_p50"] = _p50_ms([p[phase] for p in own])
    # apply's time includes the wake-ups; the consumers themselves run later, on the loop, outside these
    report["scheduler_cache_bus_ms_p50"] = _p50_ms([p["schedule"] + p["apply"] - p["wake"] + p["publish"] for p in own])
    report["engine_own_ms_p50"] = _p50_ms([p["schedule"] + p["prepare"] + p["apply"] + p["publish"] for p in own])
    return report


def _p50_ms(values: list[float]) -> float:
    return round(1000 * sorted(values)[len(values) // 2], 3)
