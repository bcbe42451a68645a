"""Golden end-to-end exposition of a small node (node_exporter's e2e-output.txt idea).

Any change to names, labels, help texts, bucket layouts or values shows up as a diff here. After an
intended change, regenerate with ``KVWATCH_UPDATE_GOLDEN=1 pytest tests/export/test_golden_exposition.py``
and review the diff like code.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvwatch.export.encode import TextEncoder

from .node import full_node_registry

GOLDEN = Path(__file__).resolve().parent / "golden" / "node_two_replicas.prom"
#: build info carries the Python and bindings versions of the machine running the test
VOLATILE = re.compile(r"^kvwatch_build_info\{.*\n", re.MULTILINE)


def render() -> str:
    return VOLATILE.sub("", TextEncoder().encode(full_node_registry(replicas=2)).decode())


def test_exposition_matches_the_golden_file():
    text = render()
    if os.environ.get("KVWATCH_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    golden = GOLDEN.read_text()
    if text != golden:
        import difflib

        diff = "".join(difflib.unified_diff(golden.splitlines(True), text.splitlines(True),
                                            "golden", "now", n=1))
        raise AssertionError(f"exposition changed (regenerate with KVWATCH_UPDATE_GOLDEN=1):\n{diff[:6000]}")


def test_golden_holds_every_catalog_area():
    from kvwatch.catalog import CATALOG

    golden = GOLDEN.read_text()
    exposed = {line.split()[2] for line in golden.splitlines() if line.startswith("# TYPE ")}
    areas = {spec.area for spec in CATALOG if set(spec.series_names) & exposed or spec.name in exposed}
    assert areas >= {"self", "replica", "derived", "gpu", "request", "plugin"}
