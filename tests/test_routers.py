"""Router plugins on plain values: where each built-in places requests, and the prefix hashes it reads are the
prefix cache's own."""

from __future__ import annotations

import random

import pytest

from jitney.cache.manager import block_hashes
from jitney.core.hooks import make_plugin_manager, registry
from jitney.routers import LeastLoaded, PrefixAffinity, ReplicaLoad, RoundRobin, RoutedRequest, RouterConfig


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
