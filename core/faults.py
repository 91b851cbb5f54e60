"""Containing plugin faults: a scheduler's batch checked before it runs, observers called one by one, and
each distinct plugin error logged once (a broken plugin fails at every step; its log must stay readable)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from jitney.core.sequence import Sequence

if TYPE_CHECKING:
    import pluggy

    from jitney.core.config import EngineConfig
    from jitney.schedulers.base import CacheView

log = logging.getLogger("jitney")


class PluginFault(Exception):
    """A plugin raised or broke its contract; the message names the plugin and the cause. `batch`: the
    scheduler's batch, where it returned one (its requests fail with it)."""

    def __init__(self, message: str, batch: Any = None):
        super().__init__(message)
        self.batch = batch


class ErrorLog:
    """Logs each distinct (plugin, error) once with its traceback; repeats are counted, not logged."""

    def __init__(self, limit: int = 1000):
        self.counts: dict[tuple[str, str], int] = {}
        self.limit = limit  # distinct errors remembered (a plugin whose messages never repeat stays bounded)

    def report(self, who: str, exc: BaseException) -> None:
        key = (who, f"{type(exc).__name__}: {exc}")
        seen = self.counts.get(key, 0)
        if len(self.counts) < self.limit or seen:
            self.counts[key] = seen + 1
        if not seen:
            log.error("%s failed: %s (logged once; the engine carries on)", who, key[1], exc_info=exc)


def check_batch(batch: Any, waiting: list[Sequence], active: list[Sequence], config: EngineConfig,
                cache: CacheView) -> list[str]:
    """What is wrong with a scheduler's `batch` (empty when it can run): every entry one of the requests it
    was given, once, with 1 to `remaining` tokens and its cache reserved; the token and request budgets
    kept; every request to preempt an active one outside the batch."""
    from jitney.schedulers.base import Batch

    if not isinstance(batch, Batch):
        return [f"returned {type(batch).__name__}, not a Batch"]
    problems = []
    given = {id(s) for s in waiting}
    given.update(id(s) for s in active)
    running = {id(s) for s in active}
    seen: set[int] = set()
    tokens = 0
    for entry in batch.entries:
        if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], Sequence)
                and type(entry[1]) is int):
            return problems + [f"an entry is {entry!r}, not (Sequence, int)"]
        seq, n = entry
        if id(seq) not in given or seq.status.done:
            problems.append(f"request {seq.request_id} is not one it was given")
        elif id(seq) in seen:
            problems.append(f"request {seq.request_id} appears twice")
        elif not 1 <= n <= seq.remaining:
            problems.append(f"request {seq.request_id} gets {n} tokens, it has {seq.remaining} left to compute")
        elif cache.blocks_needed(seq.request_id, seq.num_computed + n):
            problems.append(f"request {seq.request_id}'s cache for {n} tokens is not reserved")
        seen.add(id(seq))
        tokens += n
    if tokens > config.max_batch_tokens:
        problems.append(f"the batch has {tokens} tokens, over max_batch_tokens={config.max_batch_tokens}")
    if len(batch.entries) > config.max_requests_per_batch:
        problems.append(f"the batch has {len(batch.entries)} requests, over "
                        f"max_requests_per_batch={config.max_requests_per_batch}")
    victims: set[int] = set()
    for seq in batch.preempt:
        if not isinstance(seq, Sequence) or id(seq) not in running or id(seq) in victims:
            problems.append(f"asked to preempt {getattr(seq, 'request_id', seq)!r}, not an active request (once)")
        elif id(seq) in seen:
            problems.append(f"asked to preempt request {seq.request_id}, which is in its batch")
        victims.add(id(seq))
    for entry in batch.stalled:
        if not (isinstance(entry, tuple) and len(entry) == 2 and type(entry[1]) is int and entry[1] >= 0):
            problems.append(f"a stalled entry is {entry!r}, not (Sequence, blocks needed)")
            break
    return problems


def batch_requests(batch: Any) -> list[Sequence]:
    """The requests a (possibly malformed) batch names: what fails with it."""
    out = []
    for part in (getattr(batch, "entries", None) or (), getattr(batch, "preempt", None) or ()):
        for item in part:
            seq = item[0] if isinstance(item, tuple) and item else item
            if isinstance(seq, Sequence) and not seq.status.done:
                out.append(seq)
    return out


def notify_observers(pm: pluggy.PluginManager, errors: ErrorLog, events: list, engine: Any) -> None:
    """Call every plugin's `jitney_on_events` on its own (in pluggy's order): one that raises is reported and
    the others still see every event. A single pluggy call would stop at the first exception."""
    for impl in reversed(pm.hook.jitney_on_events.get_hookimpls()):
        args = {"events": events, "engine": engine}
        try:
            impl.function(*[args[name] for name in impl.argnames])
        except Exception as exc:
            name = getattr(impl.plugin, "__name__", None) or type(impl.plugin).__name__  # (a module, or an object)
            errors.report(f"observer {name} (jitney_on_events)", exc)

