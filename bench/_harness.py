"""What the benches share: timing, percentiles, the ratio against a peer, and the common flags.

A bench runs as ``.venv/bin/python bench/NAME.py`` (its folder first on ``sys.path``, so
``import _harness`` finds this file); kvwatch comes from the venv's install. Every bench takes
``--quick``: a run of a few seconds that proves it still works (``tests/test_benches.py`` runs each
one so, as a slow test), not a measurement.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from aiohttp import web


def parser(doc: str | None) -> argparse.ArgumentParser:
    """The bench's argument parser: its docstring as the help text, and ``--quick``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a few seconds' run that checks the bench works; its figures mean nothing",
    )
    return p


def median_seconds(fn: Callable[[], object], runs: int) -> float:
    """The median wall time of ``runs`` calls of ``fn``."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ratio(peer: float, ours: float) -> float:
    """How many times faster kvwatch is than the peer measured in the same run (>1: faster)."""
    return peer / ours if ours else float("inf")


async def listen(runner: web.AppRunner) -> int:
    """One more loopback port for a set-up runner (port 0: the kernel picks); the port bound."""
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return int(runner.addresses[-1][1])  # (host, port) of the socket just bound
