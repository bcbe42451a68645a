"""Prometheus text format 0.0.4, byte-identical to ``prometheus_client.generate_latest``, ~4x faster.

A full 8-replica node is ~7,000 samples; ``generate_latest`` re-validates and re-escapes every label
name of every sample (~6 µs a sample), which put ``/metrics`` at ~45 ms. kvwatch's label names come
from its catalog (already valid) and the same label sets recur every scrape, so the rendered label
block of each sample is cached by its label items. ``tests/export/test_encode.py`` holds this
encoder to byte equality with ``generate_latest`` on a full node; docs/performance.md has the figures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from kvwatch.catalog import MetricSpec

#: what the encoder writes; prometheus_client >= 0.22's CONTENT_TYPE_LATEST names text format 1.0.0
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_MAX_CACHED_LABEL_SETS = 200_000
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")
_TYPE_MAP = {"info": "gauge", "stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}


def _go_float(value: float) -> str:
    """``floatToGoString`` with a fast path for the small whole numbers bucket counts are."""
    if value.is_integer() and 0 <= value < 1e6:
        return f"{int(value)}.0"
    return floatToGoString(value)


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


class HistogramRows(Metric):
    """A histogram family whose lines the encoder renders from cached per-series prefixes.

    Request histograms are most of a busy node's exposition (6 families x bands x replicas x ~20
    buckets); their label sets never change, so each series' line prefixes are built once.
    ``samples`` is still available (built on demand) for any other consumer of the collector.
    """

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        super().__init__(name, documentation, "histogram")
        self.labelnames = labelnames
        self.rows: list[tuple[tuple[str, ...], tuple[str, ...], list[float], float]] = []

    @classmethod
    def of(cls, family: MetricSpec) -> Self:
        """An empty family as the catalog declares it."""
        return cls(family.name, family.help, family.labels)

    def add_row(
        self, label_values: tuple[str, ...], le_labels: tuple[str, ...], cumulative: list[float], total: float
    ) -> None:
        """One series: ``le`` strings (``+Inf`` last) with their cumulative counts, and the sum."""
        self.rows.append((label_values, le_labels, cumulative, total))

    # prometheus_client declares Metric.samples a plain attribute; a read-only property overrides it
    @property
    def samples(self) -> list[Sample]:  # type: ignore[override]
        out: list[Sample] = []
        for values, les, counts, total in self.rows:
            labels = dict(zip(self.labelnames, values, strict=True))
            out.extend(
                Sample(f"{self.name}_bucket", {**labels, "le": le}, float(c))
                for le, c in zip(les, counts, strict=True)
            )
            out.append(Sample(f"{self.name}_count", labels, float(counts[-1])))
            out.append(Sample(f"{self.name}_sum", labels, float(total)))
        return out

    @samples.setter
    def samples(self, _value: list[Sample]) -> None:  # Metric.__init__ assigns []
        pass


class TextEncoder:
    """Renders a registry (or any collector) to the text format; keeps a label-block cache."""

    def __init__(self) -> None:
        self._labels: dict[tuple[tuple[str, str], ...], str] = {}
        self._prefixes: dict[tuple[str, tuple[str, ...], tuple[str, ...]], tuple[list[str], str, str]] = {}

    def _label_block(self, labels: dict[str, str]) -> str:
        if not labels:
            return ""
        key = tuple(labels.items())
        block = self._labels.get(key)
        if block is None:
            if len(self._labels) >= _MAX_CACHED_LABEL_SETS:
                self._labels.clear()
            block = "{" + ",".join(f'{k}="{_escape_value(v)}"' for k, v in sorted(labels.items())) + "}"
            self._labels[key] = block
        return block

    def encode(self, collector: Collector) -> bytes:
        out: list[str] = []
        append = out.append
        label_block = self._label_block
        for metric in collector.collect():
            name, kind = metric.name, metric.type
            if kind == "counter":
                exposed = name + "_total"
            elif kind == "info":
                exposed = name + "_info"
            else:
                exposed = name
            help_text = _escape_help(metric.documentation)
            append(f"# HELP {exposed} {help_text}\n# TYPE {exposed} {_TYPE_MAP.get(kind, kind)}\n")
            if isinstance(metric, HistogramRows):
                self._histogram_rows(metric, append)
                continue
            extra: dict[str, list[str]] = {}
            for s in metric.samples:
                line = self._sample(s, label_block)
                suffix = _om_suffix(s.name, name)
                if suffix is None:
                    append(line)
                else:
                    extra.setdefault(suffix, []).append(line)
            for suffix, lines in sorted(extra.items()):
                append(f"# HELP {name}{suffix} {help_text}\n# TYPE {name}{suffix} gauge\n")
                out.extend(lines)
        return "".join(out).encode("utf-8")

    def _histogram_rows(self, metric: HistogramRows, append: Callable[[str], None]) -> None:
        for values, les, counts, total in metric.rows:
            buckets, count_prefix, sum_prefix = self._row_prefixes(metric, values, les)
            for prefix, c in zip(buckets, counts, strict=True):
                append(prefix + _go_float(c) + "\n")
            append(count_prefix + _go_float(counts[-1]) + "\n")
            append(sum_prefix + floatToGoString(total) + "\n")

    def _row_prefixes(
        self, metric: HistogramRows, values: tuple[str, ...], les: tuple[str, ...]
    ) -> tuple[list[str], str, str]:
        key = (metric.name, values, les)
        cached = self._prefixes.get(key)
        if cached is None:
            if len(self._prefixes) >= _MAX_CACHED_LABEL_SETS:
                self._prefixes.clear()
            labels = dict(zip(metric.labelnames, values, strict=True))
            bucket_name = metric.name + "_bucket"
            buckets = [f"{bucket_name}{self._label_block({**labels, 'le': le})} " for le in les]
            block = self._label_block(labels)
            cached = (buckets, f"{metric.name}_count{block} ", f"{metric.name}_sum{block} ")
            self._prefixes[key] = cached
        return cached

    @staticmethod
    def _sample(sample: Sample, label_block: Callable[[dict[str, str]], str]) -> str:
        stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
        return f"{sample.name}{label_block(sample.labels)} {floatToGoString(sample.value)}{stamp}\n"


def _om_suffix(sample_name: str, family: str) -> str | None:
    if len(sample_name) <= len(family):
        return None
    for suffix in _OM_SUFFIXES:
        if sample_name == family + suffix:
            return suffix
    return None
