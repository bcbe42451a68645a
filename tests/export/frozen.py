"""A snapshot of collected families for tests that compare two encoders (text against
generate_latest, protobuf against text): a live registry collects anew for each, and a comparison
holds only if both encode the very same families."""

from __future__ import annotations


class Frozen:
    """A collector replaying one snapshot, so both encoders see the very same families."""

    def __init__(self, families) -> None:
        self.families = list(families)

    def collect(self):
        return iter(self.families)
