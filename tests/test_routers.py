"""Router plugins on plain values: where each built-in places requests, and the prefix hashes it reads are the
prefix cache's own."""

from __future__ import annotations

import random

import pytest

from jitney.cache.manager import block_hashes
from jitney.core.hooks import make_plugin_manager, registry
from jitney.routers.base import LeastLoaded, PrefixAffinity, ReplicaLoad, RoundRobin, RoutedRequest, RouterConfig


def requests(count: int, prefix: list[int], seed: int = 0) -> list[RoutedRequest]:
    rng = random.Random(seed)
    return [RoutedRequest.of(f"r{i}", prefix + [rng.randrange(100, 1000) for _ in range(rng.randint(1, 20))], 16)
            for i in range(count)]


def fleet(*loads: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(f"replica-{i}", running=n) for i, n in enumerate(loads)]


def test_the_built_in_routers_are_registered_plugins():
    routers = registry(make_plugin_manager(), "router")
    assert {"round_robin", "least_loaded", "prefix_affinity"} <= set(routers.factories)
    with pytest.raises(ValueError, match="unknown router 'nearest'; registered: .*prefix_affinity"):
        routers.create("nearest", RouterConfig())


def test_prefix_hashes_are_the_ones_the_prefix_cache_keys_blocks_by():
    prompt = list(range(100, 150))
    routed = RoutedRequest.of("r", prompt, 16)
    assert routed.prefix_hashes == list(block_hashes(prompt[:49], 16))  # (3 full blocks; the last token's aside)
    assert len(routed.prefix_hashes) == 3
    other = RoutedRequest.of("s", prompt[:32] + [7] * 18, 16)
    assert other.prefix_hashes[:2] == routed.prefix_hashes[:2] and other.prefix_hashes[2] != routed.prefix_hashes[2]


def test_round_robin_spreads_and_least_loaded_fills_the_emptiest():
    rr = RoundRobin()
    placed = [rr.choose(r, fleet(0, 0, 0)) for r in requests(6, [])]
    assert placed == ["replica-0", "replica-1", "replica-2"] * 2
    assert LeastLoaded().choose(requests(1, [])[0], fleet(5, 2, 9)) == "replica-1"
    # what this side has sent counts as soon as it is sent, before the replica reports it
    loads = [ReplicaLoad("a", running=1, outstanding=6), ReplicaLoad("b", running=3)]
    assert LeastLoaded().choose(requests(1, [])[0], loads) == "b"


def test_prefix_affinity_keeps_a_shared_prefix_on_one_replica_within_the_load_bound():
    router = PrefixAffinity(RouterConfig(imbalance=0.5))
    system_a, system_b = [11] * 64, [12] * 64
    first_a = router.choose(requests(1, system_a)[0], fleet(0, 0))
    first_b = router.choose(requests(1, system_b, seed=1)[0], fleet(1, 0))
    assert first_a != first_b  # a new prefix goes to the least loaded
    balanced = fleet(3, 3)
    assert {router.choose(r, balanced) for r in requests(8, system_a, seed=2)} == {first_a}
    assert {router.choose(r, balanced) for r in requests(8, system_b, seed=3)} == {first_b}
    # past (1 + e) x the average load (+1), the prefix's replica is passed over for the least loaded
    busy = [ReplicaLoad(first_a, running=12), ReplicaLoad(first_b, running=2)]
    assert router.choose(requests(1, system_a, seed=4)[0], busy) == first_b
    # the prefix is now held by both: the next request sharing it takes the less loaded of the two
    assert router.choose(requests(1, system_a, seed=5)[0], [ReplicaLoad(first_a, running=2),
                                                            ReplicaLoad(first_b, running=4)]) == first_a


def test_prefix_affinity_follows_the_longest_known_prefix_and_forgets_the_oldest():
    router = PrefixAffinity(RouterConfig(remembered_blocks=8))
    shared = [5] * 32
    one = router.choose(RoutedRequest.of("x", shared + [6] * 33, 16), fleet(0, 0))  # blocks: shared x2, then 6s
    two = router.choose(RoutedRequest.of("y", shared + [7] * 33, 16), [ReplicaLoad("replica-0", running=1),
                                                                        ReplicaLoad("replica-1")])
    assert one == two  # the shared blocks lead it there, though the other is emptier (within the bound)
    for i in range(10):  # 10 new prefixes of 2 blocks: the first ones are forgotten
        router.choose(RoutedRequest.of(f"z{i}", [20 + i] * 33, 16), fleet(0, 0))
    assert len(router.holders) == 8


class _Replica:
    """What Ray's `RunningReplica` gives a request router: an id and the replica's last reported stats."""

    def __init__(self, rid: str, running: int = 0):
        self.replica_id = type("ReplicaID", (), {"unique_id": rid})()
        self.routing_stats = {"running": running, "waiting": 0}


class _Pending:
    def __init__(self, routed: RoutedRequest):
        self.args = [type("Job", (), {"routed": routed})()]
        self.metadata = type("RequestMetadata", (), {"internal_request_id": routed.request_id})()


def ray_router(policy):
    """jitney's Ray request router around `policy`, without Ray's own machinery (its methods only)."""
    from jitney.serve.cluster import _RouterMethods

    router = object.__new__(_RouterMethods)
    router.initialize_state("least_loaded")
    router.policy = policy
    return router


async def test_a_router_that_raises_or_names_no_replica_places_the_request_anywhere(caplog):
    class Raising:
        def choose(self, request, replicas):
            raise RuntimeError("boom")

    class Astray:
        def choose(self, request, replicas):
            return "nowhere"

    replicas = [_Replica("a"), _Replica("b")]
    pending = _Pending(requests(1, [])[0])
    assert await ray_router(Raising()).choose_replicas(replicas, pending) == [replicas]
    assert await ray_router(Astray()).choose_replicas(replicas, pending) == [replicas]
    assert "router Raising failed" in caplog.text and "'nowhere', not a replica" in caplog.text


async def test_the_ray_router_keeps_its_decision_while_ray_asks_again():
    router = ray_router(RoundRobin())
    replicas = [_Replica("a"), _Replica("b")]
    first, second = (_Pending(r) for r in requests(2, []))
    chosen = await router.choose_replicas(replicas, first)
    assert len(chosen) == 1 and len(chosen[0]) == 1  # that replica alone
    assert await router.choose_replicas(replicas, first) == chosen  # (its probe timed out: asked again)
    assert await router.choose_replicas(replicas, second) != chosen  # the next request is the next turn


def test_serving_several_replicas_refuses_bad_options_before_starting_anything(capsys):
    from jitney.cli import main

    assert main(["serve", "--replicas", "2", "--router", "nearest"]) == 2
    assert "unknown router 'nearest'" in capsys.readouterr().err
    assert main(["serve", "--replicas", "0"]) == 2
    assert "--replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--chunk-context-cost", "-1"]) == 2
    assert "EngineConfig.chunk_context_cost" in capsys.readouterr().err
