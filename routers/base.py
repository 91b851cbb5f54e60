"""Router plugins: which replica of a fleet serves a request (`jitney serve --replicas N --router NAME`).

A router sees the request (its prompt's token ids and the chained hashes of its first full blocks, the very
hashes each replica's prefix cache keys its blocks by) and each replica's load, and names a replica. It runs
inside Ray Serve's request-router extension point (`jitney.serve.cluster`), and needs nothing of Ray itself:
a simulation or a test drives it with plain values. Register one with::

    @hookimpl
    def jitney_register_routers(register):
        register("my_router", lambda config: MyRouter())     # config: RouterConfig
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from jitney.cache.manager import block_hashes
from jitney.core.hooks import hookimpl


@dataclass(frozen=True)
class RouterConfig:
    """What a router factory is given."""

    block_size: int = 16
    """The replicas' cache block size: a request's prefix hashes are over blocks of this many tokens."""
    imbalance: float = 0.5
    """`prefix_affinity`'s ε: a replica holding the prefix is passed over when its load exceeds (1 + ε) x the
    fleet's average (plus one request, so that an idle fleet is not "imbalanced" by a single request)."""
    remembered_blocks: int = 200_000
    """`prefix_affinity` forgets the least recently routed block hashes beyond this many."""


@dataclass(frozen=True)
class RoutedRequest:
    """A request to place."""

    request_id: str
    prompt_ids: list[int]
    prefix_hashes: list[int]
    """Chained hashes of the prompt's full blocks (`jitney.cache.manager.block_hashes`), the last block that
    holds the prompt's final token aside (a replica never serves that block from its cache)."""
    metadata: dict = field(default_factory=dict)

    @classmethod
    def of(cls, request_id: str, prompt_ids: list[int], block_size: int, metadata: dict | None = None) -> "RoutedRequest":
        hashes = list(block_hashes(prompt_ids[: len(prompt_ids) - 1], block_size))
        return cls(request_id, prompt_ids, hashes, metadata or {})


@dataclass(frozen=True)
class ReplicaLoad:
    """A replica as a router sees it."""

    replica_id: str
    running: int = 0
    """Requests its engine runs, as the replica last reported them (reports lag by up to a second)."""
    waiting: int = 0
    """Requests its engine queues, as last reported."""
    outstanding: int = 0
    """Requests routed to it that have not ended yet, counted where the routing happens (never stale)."""

    @property
    def load(self) -> int:
        """Requests on the replica: its own count, or what has been sent to it since, whichever is more."""
        return max(self.running + self.waiting, self.outstanding)


class Router(Protocol):
    """Places each request on a replica; the fleet's state comes with each call."""

    def choose(self, request: RoutedRequest, replicas: list[ReplicaLoad]) -> str:
        """The id of the replica (one of `replicas`, never empty) that should serve `request`. Called once per
        request, in arrival order; a replica that then refuses or dies gets the request placed again."""


class RoundRobin:
    """Each replica in turn, whatever the load or the prompt."""

    def __init__(self, config: RouterConfig | None = None):
        self.turn = 0

    def choose(self, request: RoutedRequest, replicas: list[ReplicaLoad]) -> str:
        self.turn += 1
        return sorted(r.replica_id for r in replicas)[(self.turn - 1) % len(replicas)]


class LeastLoaded:
    """The replica with the fewest requests (running + waiting); ties go to the lowest id."""

    def __init__(self, config: RouterConfig | None = None):
        pass

    def choose(self, request: RoutedRequest, replicas: list[ReplicaLoad]) -> str:
        return min(replicas, key=lambda r: (r.load, r.replica_id)).replica_id


class PrefixAffinity:
    """The replica that most likely holds the request's prefix in its cache: of those that were sent the
    longest run of its leading blocks, the least loaded, unless even it is past (1 + ε) x the average load;
    then, or with no known prefix, the least loaded replica. Every request marks its blocks as held by the
    replica it went to (a prefix moved for load is then held by both, and the next request sharing it takes
    the less loaded of the two)."""

    HOLDERS = 4
    """Replicas remembered per block, most recent first."""

    def __init__(self, config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()  # block hash -> replicas sent it
        self.least = LeastLoaded()

    def choose(self, request: RoutedRequest, replicas: list[ReplicaLoad]) -> str:
        chosen = self.least.choose(request, replicas)
        by_id = {r.replica_id: r for r in replicas}
        for h in reversed(request.prefix_hashes):  # (chained: the longest match is the last known one)
            held = [by_id[k] for k in self.holders.get(h, ()) if k in by_id]
            if held:
                best = min(held, key=lambda r: (r.load, r.replica_id))
                if best.load <= (1 + self.config.imbalance) * sum(r.load for r in replicas) / len(replicas) + 1:
                    chosen = best.replica_id
                break
        for h in request.prefix_hashes:
            others = tuple(k for k in self.holders.get(h, ()) if k != chosen)
            self.holders[h] = (chosen, *others)[: self.HOLDERS]
            self.holders.move_to_end(h)
        while len(self.holders) > self.config.remembered_blocks:
            self.holders.popitem(last=False)
        return chosen


@hookimpl
def jitney_register_routers(register):
    register("round_robin", RoundRobin)
    register("least_loaded", LeastLoaded)
    register("prefix_affinity", PrefixAffinity)
