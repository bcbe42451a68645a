"""Engine page parsing cost: kvwatch's exposition parser against prometheus_client's, same run.

For each real capture (and a synthetic 8-rank vLLM page, the size of a DP=8 node replica), prints
the median time of:

- ``prometheus_client.parser.text_string_to_metric_families`` (the peer),
- ``kvwatch.engines.exposition_parser.parse_text`` (ratio = peer / kvwatch: >1 means kvwatch is faster),
- ``kvwatch.engines.registry.parse_exposition`` (text -> ReplicaSamples, adapter included).

  .venv/bin/python -m bench.exposition_parse [--quick]
"""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench._harness import median_seconds, parser, ratio
from kvwatch.engines.exposition_parser import parse_text
from kvwatch.engines.registry import parse_exposition

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "engines"
PAGES = [
    FIXTURES / "vllm_0_32_cpu_preempting.prom",
    FIXTURES / "captured" / "vllm-0.13-0.14-v1-lmcache-dynamo-2026-01-2.prom",
    FIXTURES / "captured" / "sglang-0.5.6-0.5.8-dynamo-2026-01-2.prom",
    FIXTURES / "captured" / "llamacpp-0.5.0dev-tiny.prom",
]


def eight_ranks(text: str) -> str:
    """The real vLLM page with every engine="0" series repeated for engines 0..7."""
    out = []
    for line in text.splitlines():
        if 'engine="0"' in line:
            out += [re.sub(r'engine="0"', f'engine="{i}"', line) for i in range(8)]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def main() -> None:
    args = parser(__doc__).parse_args()
    runs = 2 if args.quick else 30
    pages = [(p.name, p.read_text()) for p in PAGES]
    pages.append(("vllm_0_32 x 8 DP ranks (synthetic)", eight_ranks(pages[0][1])))
    print(
        f"{'page':48} {'bytes':>8} {'prom_client ms':>15} {'kvwatch ms':>11} {'ratio':>6} {'+adapter ms':>12}"
    )
    for name, text in pages:
        peer = median_seconds(lambda text=text: list(text_string_to_metric_families(text)), runs) * 1000
        ours = median_seconds(lambda text=text: parse_text(text), runs) * 1000
        full = median_seconds(lambda text=text: parse_exposition(text, "r0", scraped_at=0.0), runs) * 1000
        print(
            f"{name[:48]:48} {len(text):>8} {peer:>15.2f} {ours:>11.2f} {ratio(peer, ours):>6.2f} "
            f"{full:>12.2f}"
        )


if __name__ == "__main__":
    main()
