"""Engine pages an attacker would serve, built from a real capture (shared by tests and bench/)."""

from __future__ import annotations

import re
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
VLLM_PAGE = FIXTURES / "vllm_0_32_cpu_preempting.prom"


def vllm_page() -> str:
    return VLLM_PAGE.read_text()


#: the per-rank families repeated by ``many_ranks``
RANK_FAMILIES = (
    "vllm:num_requests_running{",
    "vllm:num_requests_waiting{",
    "vllm:kv_cache_usage_perc{",
    "vllm:num_preemptions_total{",
)


def many_ranks(ranks: int) -> str:
    """The real vLLM page with its per-rank gauges and counters repeated for engines 0..ranks-1.

    3,200 ranks are then about 1 MB, the page that once took 11 s to read.
    """
    out = []
    for line in vllm_page().splitlines():
        if 'engine="0"' in line and line.startswith(RANK_FAMILIES):
            out += [line.replace('engine="0"', f'engine="{i}"') for i in range(ranks)]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def many_finished_reasons(values: int) -> str:
    """The real page plus ``values`` distinct ``finished_reason`` label values."""
    extra = "".join(
        f'vllm:request_success_total{{engine="0",finished_reason="r{i}",model_name="tiny"}} 1\n'
        for i in range(values)
    )
    return vllm_page() + extra


def unrelated_series(approx_bytes: int) -> str:
    """The real page followed by ``approx_bytes`` of series no adapter reads, each a new name."""
    line = 'process_unrelated_series_{i}{{job="x",instance="y",shard="{i}"}} 12345.0\n'
    count = approx_bytes // len(line.format(i=100000))
    return vllm_page() + "".join(line.format(i=i) for i in range(count))


#: single lines that made the old sample regex backtrack, as functions of a length n
LONG_LINES = {
    "name only": lambda n: "a" * n,
    "name then junk": lambda n: "a" * n + " 1 2 3",
    "open label value": lambda n: 'a{b="' + "x" * n,
    "many labels": lambda n: "a{" + 'b="c",' * (n // 6) + "} 1",
    "many labels no close": lambda n: "a{" + 'b="c",' * (n // 6) + " 1",
    "closing braces": lambda n: "a{" + "}" * n + " 1",
    "escapes": lambda n: 'a{b="' + "\\\\" * (n // 2) + " 1",
    "spaces": lambda n: "a" + " " * n + "1 x",
}


def engine_label(value: str) -> str:
    """The real page with engine="0" replaced by ``value`` (odd ranks: ``²``, 5,000 digits)."""
    return re.sub('engine="0"', f'engine="{value}"', vllm_page())
