"""What the benches share: timing, percentiles, the ratio against a peer, and the common flags.

A bench runs from the repository root as ``.venv/bin/python -m bench.NAME``: ``bench``, ``kvwatch``
and the tests' public helper modules (``tests.e2e.reference_node``, ``tests.derive.simulated``, ...)
import from the checkout, with no change to ``sys.path``. Every bench takes ``--quick``: a run of
seconds (a minute at most) through the same code paths with tiny sizes, which proves it still works
(``tests/test_benches.py`` runs each one so, as a slow test); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

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


def load_module(path: Path, name: str) -> ModuleType:
    """The Python file ``path`` imported as module ``name`` (a file outside any package on the path:
    another checkout's copy of a module, the vLLM plugin's stdlib-only ``wire.py``)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
