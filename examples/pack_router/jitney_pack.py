"""A jitney router plugin: fill the replicas in order, each up to a number of requests, so the last ones stay
idle (and could be scaled down) while the traffic fits in fewer."""

from jitney.core.hooks import hookimpl

FULL = 8
"""Requests a replica takes before the next one gets any."""


class Pack:
    """The first replica (by id) with room; the least loaded when all are full."""

    def __init__(self, config):
        self.config = config

    def choose(self, request, replicas):
        ordered = sorted(replicas, key=lambda r: r.replica_id)
        room = [r for r in ordered if r.load < FULL]
        return (room or sorted(ordered, key=lambda r: r.load))[0].replica_id


@hookimpl
def jitney_register_routers(register):
    register("pack", Pack)
