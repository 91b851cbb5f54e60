"""S3-FIFO (Yang et al., SOSP 2023) as a jitney eviction policy: a packaged plugin, found through the `jitney`
entry-point group.

Blocks never reused since they were computed sit in a small FIFO and go first, oldest first: most prefixes are
one-offs, and S3-FIFO's finding is that they should leave quickly. Blocks reused at least once sit in the main
FIFO, ordered by how often they were reused (up to 3) and then by age, which approximates its reinsertion of
reused objects. A block demoted from the small FIFO leaves its hash in a ghost FIFO as large as the cache; when
that content is computed again while still remembered, it goes straight to the main FIFO.
"""

from __future__ import annotations

from jitney.core.hooks import hookimpl


class S3Fifo:
    def setup(self, num_blocks):
        self.ghost_limit = num_blocks
        self.ghosts = {}  # content hash -> None, oldest first

    def on_demote(self, block):
        if not block.hits:
            self.ghosts[block.hash] = None
            if len(self.ghosts) > self.ghost_limit:
                del self.ghosts[next(iter(self.ghosts))]

    def priority(self, block):
        if block.hits or block.hash in self.ghosts:
            return (1, min(block.hits, 3), block.created)
        return (0, 0, block.created)


@hookimpl
def jitney_register_eviction_policies(register):
    register("s3fifo", lambda config: S3Fifo())
