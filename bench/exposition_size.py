"""/metrics of the reference node (docs/scale.md): series, and bytes on the wire with and without gzip,
for both metrics profiles and both expositions (text, protobuf), in the same run.

The node is the scale test's (tests/e2e/reference_node.py): the real agent in this process, 8
replicas whose engines serve a real vLLM 0.13 + LMCache + Dynamo capture, 8 fake H200s, every band x
outcome seen. Each scrape is a real HTTP GET; "wire" is the response body as sent (after gzip when
asked), read raw. Time per scrape is the median of ``--scrapes`` GETs; the gzip column's ratio is
against the identity scrape of the same profile and exposition, measured in the same run.

  .venv/bin/python -m bench.exposition_size [--scrapes 20] [--quick]
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import statistics
import time

import httpx

from bench._harness import parser as bench_parser
from kvwatch.export.protobuf import PROTOBUF_CONTENT_TYPE
from tests.e2e.reference_node import reference_node

#: what Prometheus 2.42 sends (scrape/scrape.go): gzip, and the text exposition unless asked for protobuf
ACCEPT = {"text": "text/plain;version=0.0.4;q=0.5,*/*;q=0.1", "protobuf": PROTOBUF_CONTENT_TYPE}


async def _scrape(client: httpx.AsyncClient, url: str, accept: str, encoding: str) -> tuple[int, int, float]:
    """(bytes on the wire, bytes decoded, seconds) of one GET."""
    started = time.perf_counter()
    async with client.stream("GET", url, headers={"Accept": accept, "Accept-Encoding": encoding}) as response:
        response.raise_for_status()
        wire = b"".join([chunk async for chunk in response.aiter_raw()])
    elapsed = time.perf_counter() - started
    sent = response.headers.get("Content-Encoding", "identity")
    if sent != encoding:
        raise SystemExit(f"asked for {encoding}, got {sent}")
    decoded = gzip.decompress(wire) if sent == "gzip" else wire
    return len(wire), len(decoded), elapsed


async def _profile(profile: str, scrapes: int) -> list[str]:
    rows = []
    async with reference_node(profile) as agent, httpx.AsyncClient(timeout=30) as client:
        url = f"http://127.0.0.1:{agent.port}/metrics"
        text = (await client.get(url, headers={"Accept": ACCEPT["text"]})).text
        series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
        for exposition, accept in ACCEPT.items():
            timed: dict[str, float] = {}
            for encoding in ("identity", "gzip"):
                runs = [await _scrape(client, url, accept, encoding) for _ in range(scrapes)]
                wire, decoded, _ = runs[-1]
                timed[encoding] = statistics.median(r[2] for r in runs)
                ratio = f"{timed[encoding] / timed['identity']:.2f}x" if encoding == "gzip" else "1.00x"
                rows.append(
                    f"| {profile} | {series:,} | {exposition} | {encoding} | "
                    f"{wire / 1024:,.0f} KiB | {decoded / wire:.1f} | "
                    f"{timed[encoding] * 1000:.0f} ms ({ratio}) |"
                )
    return rows


async def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--scrapes", type=int, default=20, help="GETs per (profile, exposition, encoding)")
    args = parser.parse_args()
    if args.quick:
        args.scrapes = 2
    logging.basicConfig(level=logging.ERROR)  # the XID warnings; 0.3 s polls skip runs on a busy machine
    print(
        "| profile | series | exposition | Content-Encoding | bytes on the wire | decoded / wire | "
        "scrape (median) |"
    )
    print("|---|---|---|---|---|---|---|")
    for profile in ("lean", "full"):
        for row in await _profile(profile, args.scrapes):
            print(row)


if __name__ == "__main__":
    asyncio.run(main())
