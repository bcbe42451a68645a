"""Handlers for tests/test_workers.py, in a module the worker process can import as ``tests.worker_handlers``
(a test module itself is imported by pytest under a name the worker cannot resolve)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def echo_sizes(args: Any, body: bytes) -> Iterator[Any]:
    """A handler no kvwatch module names: the worker imports this module to run it."""
    yield ("size", len(body))
    yield ("args", args)


def broken(args: Any, body: bytes) -> Iterator[Any]:
    yield from ()  # a generator, as handlers are: it raises on the first next()
    raise RuntimeError("handler bug")
