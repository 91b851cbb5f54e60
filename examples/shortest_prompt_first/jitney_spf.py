"""A jitney scheduler plugin: active requests as FIFO does, then waiting requests shortest prompt first."""

from jitney.core.hooks import hookimpl
from jitney.schedulers.base import BatchBuilder, decodes, prefills


class ShortestPromptFirst:
    """Short prompts start first, so many quick requests are not held behind one long prompt."""

    def __init__(self, config):
        self.config = config
        self.safety_margin = 0.15 if config.safety_margin is None else config.safety_margin

    def schedule(self, waiting, active, cache):
        b = BatchBuilder(self.config, cache, self.safety_margin)
        b.add_active(decodes(active) + prefills(active))
        b.add_waiting(sorted(waiting, key=lambda s: (s.remaining, s.arrival)))
        return b.batch


@hookimpl
def jitney_register_schedulers(register):
    register("shortest-prompt-first", ShortestPromptFirst)
