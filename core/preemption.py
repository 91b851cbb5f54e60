"""Memory pressure: preempting requests (offload or soft reset) to free cache, and bringing them back."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from jitney.core import events as ev
from jitney.core.faults import PluginFault, check_batch
from jitney.core.request import RequestStatus
from jitney.core.sequence import Sequence

if TYPE_CHECKING:
    from jitney.cache.offload import OffloadBackend
    from jitney.core.engine import Engine
    from jitney.schedulers.base import Batch, Scheduler


def _by_arrival(seq: Sequence) -> int:
    return seq.arrival


class Preempter:
    """Frees cache for stalled requests, the seed's way: the fewest requests that cover the demand, newest
    first, never one in the step's batch and never the last active one. A preempted request goes to the
    offload backend when it has room (all of a step's offloads in one batched copy) and comes back later
    without recomputation; otherwise it is soft reset: its blocks are freed and it queues again, to prefill
    its prompt plus the tokens it already produced (prefix caching often still holds most of them)."""

    def __init__(self, engine: Engine, backend: OffloadBackend | None):
        self.engine = engine
        self.backend = backend
        self.offloaded: list[Sequence] = []  # arrival order
        self._stored: dict[str, int] = {}  # request id -> blocks held in the backend
        self.total = 0  # preemptions since the engine started
        self._sliding = any(g.window is not None for g in engine.cache.groups)

    def schedule(self, scheduler: Scheduler, name: str) -> Batch:
        """Ask `scheduler` for a batch, handling memory pressure: offloaded requests come back first when there
        is room; what the scheduler asks to preempt is preempted; if some active requests stalled, enough
        requests outside the batch are preempted that they can allocate next step; if nothing fits at all,
        requests are preempted and the scheduler asked again, within this step.

        Every retry preempts at least one active request and nothing comes back within the step (a request
        offloaded here and resumed at once could be preempted again forever), so this ends; a scheduler that
        raises or returns a batch the engine cannot run raises `PluginFault` naming it (`name`)."""
        engine = self.engine
        self.resume()
        for _ in range(len(engine.active) + 2):
            try:
                batch = scheduler.schedule(engine.waiting, engine.active, engine.cache)
            except Exception as exc:
                raise self._fault(name, f"{type(exc).__name__}: {exc}", exc) from exc
            problems = check_batch(batch, engine.waiting, engine.active, engine.config, engine.cache)
            if problems:
                raise self._fault(name, f"an invalid batch: {'; '.join(problems)}", batch=batch)
            if batch.preempt:
                self.preempt(batch.preempt)
                continue
            demand = sum(need for _, need in batch.stalled)
            if batch.entries:
                if demand:
                    self.relieve(demand, keep={s.request_id for s, _ in batch.entries})
                return batch
            if not self.relieve(max(demand, 1), keep=set()):
                # submit() refuses requests that cannot fit in the whole cache, so this is a scheduler bug
                raise self._fault(name, f"an empty batch with {len(engine.waiting)} requests waiting and "
                                        f"{len(engine.active)} active")
        raise self._fault(name, "no runnable batch after preempting every request it asked for")

    def _fault(self, name: str, cause: str, exc: BaseException | None = None, batch=None) -> PluginFault:
        fault = PluginFault(f"scheduler {name!r} failed: {cause}", batch)
        self.engine.errors.report(f"scheduler {name!r}", exc or fault)
        return fault

    def relieve(self, demand: int, keep: set[str]) -> bool:
        """Preempt the newest active requests outside `keep` until `demand` blocks are freed (or only one
        active request is left). Returns whether anything was preempted."""
        active, cache = self.engine.active, self.engine.cache
        victims, freed = [], 0
        for seq in reversed(active):
            if freed >= demand or len(active) - len(victims) <= 1:
                break
            if seq.request_id not in keep:
                victims.append(seq)
                freed += cache.blocks_held(seq.request_id)
        self.preempt(victims)
        return bool(victims)

    def preempt(self, victims: list[Sequence]) -> None:
        cache = self.engine.cache
        # Sliding-window tables hold sentinels for blocks already given back; those requests soft reset.
        room = 0
        if self.backend is not None and not self._sliding:
            room = self._call("free_blocks", lambda: int(self.backend.free_blocks()), 0)
        store = {}
        for seq in victims:
            held = cache.blocks_held(seq.request_id)
            if 0 < held <= room:
                store[seq.request_id] = [cache.block_table(seq.request_id, g) for g in range(len(cache.groups))]
                room -= held
        if store and not self._call("store", lambda: self.engine.on_forward_thread(
                lambda: self.backend.store(cache, store)) or True, False):
            for request_id in store:  # whatever it kept is of no use: these requests soft reset instead
                self._call("discard", lambda: self.backend.discard(request_id), None)
            store = {}
        now = self.engine.clock()
        for seq in victims:
            self.total += 1
            self.engine.active.remove(seq)
            if seq.request_id in store:
                self._stored[seq.request_id] = cache.blocks_held(seq.request_id)
                bisect.insort(self.offloaded, seq, key=_by_arrival)
                self.engine.events.append(ev.RequestOffloaded(
                    t=now, step=self.engine.step_count + 1, request_id=seq.request_id, blocks=self._stored[seq.request_id]))
            else:
                self._soft_reset(seq, now)
            cache.release(seq.request_id)

    def resume(self) -> None:
        """Bring offloaded requests back, oldest first, while the cache keeps a block to spare for each (none
        needed when nothing else is active: the request then has the whole cache)."""
        cache = self.engine.cache
        while self.offloaded:
            seq = self.offloaded[0]
            blocks = self._stored[seq.request_id]
            spare = 1 if self.engine.active else 0
            if cache.num_free_blocks < blocks + spare or not cache.reserve(seq.request_id, blocks * cache.block_size):
                return
            self.offloaded.pop(0)
            del self._stored[seq.request_id]
            tables = [cache.block_table(seq.request_id, g) for g in range(len(cache.groups))]
            now = self.engine.clock()
            loaded = self._call("load", lambda: self.engine.on_forward_thread(
                lambda: self.backend.load(cache, seq.request_id, tables)) or True, False)
            if not loaded:  # its blocks hold nothing usable: it computes them again (its tokens are known)
                cache.release(seq.request_id)
                self._soft_reset(seq, now)
                continue
            cache.commit(seq)  # its blocks are hashed anew (the engine hashes only as blocks complete)
            bisect.insort(self.engine.active, seq, key=_by_arrival)
            self.engine.events.append(ev.RequestResumed(t=now, step=self.engine.step_count + 1, request_id=seq.request_id,
                                                        blocks=blocks))

    def _soft_reset(self, seq: Sequence, now: float) -> None:
        seq.computed_before = max(seq.computed_before, seq.num_computed)
        seq.num_computed = 0
        seq.status = RequestStatus.PENDING
        bisect.insort(self.engine.waiting, seq, key=_by_arrival)
        self.engine.events.append(ev.RequestSoftReset(t=now, step=self.engine.step_count + 1, request_id=seq.request_id,
                                                      tokens=seq.num_tokens))

    def _call(self, method: str, fn, default):
        """`fn()`, one call into the offload backend; if it raises, the error is reported with the backend's
        name and `default` returned: a broken backend costs recomputation (soft resets), never a request."""
        try:
            return fn()
        except Exception as exc:
            self.engine.errors.report(f"offload backend {self.engine.config.offload_backend!r} ({method})", exc)
            return default

    def forget(self, seq: Sequence) -> None:
        """An offloaded request ended (aborted) before coming back."""
        if seq.request_id in self._stored:
            self.offloaded.remove(seq)
            del self._stored[seq.request_id]
            self._call("discard", lambda: self.backend.discard(seq.request_id), None)
