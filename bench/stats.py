"""What a run's events add up to: prefix lookups and hits, prompt tokens computed, time to first token...
(`jitney bench` and `jitney simulate` report the same columns from them)."""

from __future__ import annotations

import math

from jitney.core import events as ev
from jitney.core.hooks import hookimpl


def percentile_ms(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 1)


def mean_ms(values: list[float]) -> float:
    """The mean in milliseconds: where a quantile sits on a gap between requests served a step apart (40 requests,
    the 21st first token one step or two after its arrival), it moves by a step at once; the mean moves a little."""
    return round(1000 * sum(values) / len(values), 1) if values else math.nan


class StepStats:
    """Sums each step's events: prefix lookups and hits, prompt tokens computed, time in the forward."""

    def __init__(self, slots: bool = True):
        self.query = self.hit = self.prefill = self.forward_s = self.steps = self.preemptions = 0
        self.gaps: list[float] = []  # seconds between consecutive tokens of a request, as its consumer saw them
        self.slots_allocated = self.slots_used = 0  # summed over steps: KV slots held vs tokens they hold
        self.drafted = self.accepted = self.speculative_steps = 0
        self.evicted = 0  # cached blocks given up to make room (`StepCompleted.blocks_demoted`)
        self.eviction: str | None = None  # the policy, set by the run
        self.scheduler: str | None = None  # and the scheduler
        self.ttft: list[float] = []  # queueing to first token, per request
        self.attention_s: float | None = None  # seconds in attention, where the one-call decoder says
        self.sampling_s = 0.0  # seconds choosing tokens from whole logits (`StepExecutor.sampling_s`)
        self.memory = None  # what the engine held, by part (`Engine.memory()`), set by the run
        self.startup_s: float | None = None  # from the engine's making to the first request (`run_jitney`)
        self.shutdown_s: float | None = None  # the engine's exit (the weights unpacked back into the model)
        self.peak_rss_mib: int | None = None  # that child's peak
        # KV slots held vs used, summed over steps (`slots`): a pass over every active request's blocks each step
        self.slots = slots

    @hookimpl
    def jitney_on_events(self, events, engine):
        for e in events:
            if isinstance(e, ev.FirstToken):
                self.ttft.append(e.ttft)
            elif isinstance(e, ev.StepCompleted):
                self.query += e.prefix_query_tokens
                self.hit += e.prefix_hit_tokens
                self.prefill += e.prefill_tokens
                self.forward_s += e.forward_s
                self.steps += 1
                self.preemptions += e.preemptions
                self.drafted += e.draft_tokens
                self.accepted += e.accepted_tokens
                self.speculative_steps += e.draft_tokens > 0
                self.evicted += e.blocks_demoted
                if not self.slots:
                    continue
                cache = engine.cache
                self.slots_allocated += sum(cache.blocks_held(s.request_id) for s in engine.active) * cache.block_size
                self.slots_used += sum(s.num_computed for s in engine.active)
