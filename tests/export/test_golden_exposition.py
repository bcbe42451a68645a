"""Golden end-to-end exposition of a small node (node_exporter's e2e-output.txt idea).

Any change to names, labels, help texts, bucket layouts or values shows up as a diff here. After an
intended change, regenerate with ``KVWATCH_UPDATE_GOLDEN=1 pytest tests/export/test_golden_exposition.py``
and review the diff like code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvwatch.export.encode import TextEncoder

from .node import full_node_registry

GOLDENS = Path(__file__).resolve().parent / "golden"
#: metrics.profile -> its golden file: ``full`` is the exposition from before profiles existed
GOLDEN = {"full": GOLDENS / "node_two_replicas.prom", "lean": GOLDENS / "node_two_replicas_lean.prom"}
#: build info carries the Python and bindings versions of the machine running the test
VOLATILE = re.compile(r"^kvwatch_build_info\{.*\n", re.MULTILINE)


def render(profile: str) -> str:
    return VOLATILE.sub("", TextEncoder().encode(full_node_registry(replicas=2, profile=profile)).decode())


@pytest.mark.parametrize("profile", sorted(GOLDEN))
def test_exposition_matches_the_golden_file(profile: str):
    text = render(profile)
    if os.environ.get("KVWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN[profile].write_text(text)
    golden = GOLDEN[profile].read_text()
    if text != golden:
        import difflib

        diff = "".join(
            difflib.unified_diff(golden.splitlines(True), text.splitlines(True), "golden", "now", n=1)
        )
        raise AssertionError(f"exposition changed (regenerate with KVWATCH_UPDATE_GOLDEN=1):\n{diff[:6000]}")


@pytest.mark.parametrize("profile", sorted(GOLDEN))
def test_golden_holds_every_catalog_area(profile: str):
    from kvwatch.catalog import CATALOG

    golden = GOLDEN[profile].read_text()
    exposed = {line.split()[2] for line in golden.splitlines() if line.startswith("# TYPE ")}
    areas = {spec.area for spec in CATALOG if set(spec.series_names) & exposed or spec.name in exposed}
    assert areas >= {"self", "replica", "derived", "gpu", "request", "plugin"}
