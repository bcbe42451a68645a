"""The agent's registry carries prometheus_client's own process and platform collectors, and the
catalog lists their families as they are rendered (name, type, help)."""

from __future__ import annotations

import os
import resource
import sys

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.catalog import CATALOG
from kvwatch.export.collector import NodeCollector
from kvwatch.export.encode import TextEncoder
from kvwatch.export.server import make_registry

from .node import full_node

STANDARD = {s.name: s for s in CATALOG if s.name.startswith(("process_", "python_"))}


def _rendered() -> dict[str, object]:
    state, config = full_node(replicas=1)
    text = TextEncoder().encode(make_registry(NodeCollector(state, config, {}))).decode()
    return {m.name: m for m in text_string_to_metric_families(text)}


def test_process_and_platform_families_are_rendered_as_the_catalog_says() -> None:
    assert sys.platform == "linux"  # the process collector reads /proc
    families = _rendered()
    assert set(STANDARD) == {
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_cpu_seconds",
        "process_open_fds",
        "process_max_fds",
        "process_start_time_seconds",
        "python_info",
    }
    for name, spec in STANDARD.items():
        family = families[name]
        assert (family.type, family.documentation) == (spec.kind, spec.help), name
        assert [tuple(sorted(s.labels)) for s in family.samples] == [tuple(sorted(spec.labels))], name


def test_the_values_agree_with_the_kernel() -> None:
    families = _rendered()
    rss = families["process_resident_memory_bytes"].samples[0].value
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    assert abs(rss - pages * os.sysconf("SC_PAGE_SIZE")) < 16 << 20  # the render itself allocates
    fds = families["process_open_fds"].samples[0].value
    assert abs(fds - len(os.listdir("/proc/self/fd"))) <= 2
    assert families["process_max_fds"].samples[0].value == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    info = families["python_info"].samples[0].labels
    assert info["version"] == ".".join(map(str, sys.version_info[:3]))
