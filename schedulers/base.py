"""The scheduler role: what a scheduler is given each step and what it returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from jitney.core.sequence import Sequence


class CacheView(Protocol):
    """The part of the cache manager a scheduler may use: ask what fits, and reserve it."""

    num_blocks: int

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """New blocks `request_id` needs to hold `num_tokens` tokens in all."""

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        """Allocate, all groups or none, so that `request_id` holds `num_tokens` tokens; False if it cannot."""


@dataclass
class Batch:
    """One step's work: `entries` are (request, tokens to compute this step), decodes first."""

    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    stalled: list[Sequence] = field(default_factory=list)
    """Active requests that could not get the blocks they need this step."""

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)


class Scheduler(Protocol):
    """Builds each step's batch. Registered with ``jitney_register_schedulers`` as ``factory(config)``.

    `schedule` is called once per step with the requests not yet started (`waiting`, arrival order) and the
    ones that hold cache (`active`, arrival order); it reserves the cache each chosen request needs through
    `cache` and returns the batch. It must respect ``config.max_batch_tokens`` (query tokens) and
    ``config.max_requests_per_batch``. The engine moves requests between the two lists; the scheduler only
    chooses.
    """

    def schedule(self, waiting: list[Sequence], active: list[Sequence], cache: CacheView) -> Batch: ...
