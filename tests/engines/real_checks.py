"""Helpers for the real-engine tests: the engine's own numbers (read with prometheus_client's parser,
an implementation independent of kvwatch's) next to what ``kvwatch inspect --json`` says."""

from __future__ import annotations

import contextlib
import io
import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvwatch import cli


def engine_metrics(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)], straight from the engine."""
    return metrics_of(httpx.get(url, timeout=30.0).text)


def metrics_of(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] of one exposition page."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def value(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    ((_, v),) = metrics[name]
    return v


def inspect_json(source: str) -> dict[str, Any]:
    """Run ``kvwatch inspect --json SOURCE`` (a URL or a file) in-process, the real command code path,
    and parse its output."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(["inspect", "--json", "--timeout", "30", source])
    assert code == 0, buffer.getvalue()
    return json.loads(buffer.getvalue())
