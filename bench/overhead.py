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

    def __call__(self, prepared):
        self.executor.zero_new_blocks(prepared)  # cache work that the real forward does first
        self.executor.forward_s = 0.0
        result = [None] * prepared.num_entries
        for i, count in zip(prepared.sampled_entries, prepared.samples_per_entry):
            result[i] = [7] * count
        return result


class StepTimes:
    def __init__(self):
        self.steps: list[StepCompleted] = []

    @hookimpl
    def jitney_on_events(self, events, engine):
        self.steps += [e for e in events if isinstance(e, StepCompleted)]


def measure(model, tokenizer, requests: int = 256, prompt_len: int = 64, new_tokens: int = 200, block_size: int = 16) -> dict:
    """Run `requests` requests through the engine with the model replaced by `NullForward`; per-step times
    once every request is decoding."""
    from jitney import Engine, EngineConfig, Request, SamplingParams

    blocks = requests * -(-(prompt_len + new_tokens) // block_size)
    config = EngineConfig(num_blocks=blocks, block_size=block_size, max_batch_tokens=requests * prompt_len,
                          max_requests_per_batch=requests)
    times = StepTimes()
    engine = Engine(model, tokenizer, config, plugins=[times])
    engine.executor.forward = NullForward(engine.executor)

    async def main() -> None:
        async with engine, anyio.create_task_group() as tg:
            for i in range(requests):
                tg.start_soon(engine.generate, Request([100 + i % 50] * prompt_len, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))

    t = time.perf_counter()
    anyio.run(main)
    wall = time.perf_counter() - t
    full = [s for s in times.steps if s.requests == requests and s.prefill_tokens == 0]
    per_step = sorted(s.step_s for s in full)
    return {
        "requests": requests, "steps": len(times.steps), "full_decode_steps": len(full),
        "step_ms_p50": round(1000 * per_step[len(per_step) // 2], 3),
        "step_ms_mean": round(1000 * sum(per_step) / len(per_step), 3),
        "wall_per_step_ms": round(1000 * wall / len(times.steps), 3),
    }
