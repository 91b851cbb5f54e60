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
    kept; every request to preempt an active one outside the batch.

    Run every step over every entry, so the common entry costs a few operations: a decode within a block it
    already holds needs no reservation (the cache always holds a request's computed tokens); the engine's own
    lists hold only requests that have not ended."""
    from jitney.schedulers.base import Batch

    if not isinstance(batch, Batch):
        return [f"returned {type(batch).__name__}, not a Batch"]
    problems = []
    given = set(map(id, waiting))
    given.update(map(id, active))
    seen: set[int] = set()
    tokens = 0
    bs = cache.block_size
    needed = cache.blocks_needed
    for entry in batch.entries:
        try:
            seq, n = entry
        except (TypeError, ValueError):
            return problems + [f"an entry is {entry!r}, not (Sequence, int)"]
        key = id(seq)
        if key not in given:
            problems.append(f"{getattr(seq, 'request_id', seq)!r} is not a request it was given")
            continue
        if key in seen:
            problems.append(f"request {seq.request_id} appears twice")
            continue
        seen.add(key)
        if type(n) is not int:
            problems.append(f"request {seq.request_id} gets {n!r} tokens, not an int")
            continue
        tokens += n
        computed = seq.num_computed
        left = len(seq.prompt_ids) + len(seq.output_ids) - computed
        if not 1 <= n <= left:
            problems.append(f"request {seq.request_id} gets {n} tokens, it has {left} left to compute")
        elif (n > 1 or not computed % bs) and needed(seq.request_id, computed + n):
            problems.append(f"request {seq.request_id}'s cache for {n} tokens is not reserved")
    if tokens > config.max_batch_tokens:
        problems.append(f"the batch has {tokens} tokens, over max_batch_tokens={config.max_batch_tokens}")
    if len(batch.entries) > config.max_requests_per_batch:
        problems.append(f"the batch has {len(batch.entries)} requests, over "
                        f"max_requests_per_batch={config.max_requests_per_batch}")
    if batch.preempt:
        running = set(map(id, active))
        victims: set[int] = set()
        for seq in batch.preempt:
            if id(seq) not in running or id(seq) in victims:
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

