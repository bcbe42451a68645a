"""Hugging Face TGI router ``/metrics`` (``tgi_*``, Rust ``metrics-exporter-prometheus``).

One model per server, no labels identifying it. What exists: queue size (waiting), current batch size
(running), ``tgi_batch_max_total_tokens`` (the KV token budget TGI sized at warm-up from free memory:
capacity), and ``tgi_batch_current_max_tokens`` (tokens the current batch *may* grow to: a reservation,
not occupancy). TGI exports no KV occupancy, prefix-cache or preemption metrics: those fields stay None.
Counters carry no ``_total`` suffix. Token totals come from the ``_sum`` of the per-request
histograms (``tgi_request_input_length``, ``tgi_request_generated_tokens``): cumulative over finished
requests.
"""

from __future__ import annotations

from kvwatch.engines.base import Field, RankView, Scrape, read_fields, read_histograms
from kvwatch.engines.exposition_parser import Exposition
from kvwatch.model import ReplicaSample

BACKEND = "tgi"
PREFIX = "tgi_"

FIELDS: tuple[Field, ...] = (
    Field("requests_waiting", ("tgi_queue_size",)),
    Field("requests_running", ("tgi_batch_current_size",)),
    Field("kv_capacity_tokens", ("tgi_batch_max_total_tokens",)),
    Field("prompt_tokens_total", ("tgi_request_input_length_sum",)),
    Field("generation_tokens_total", ("tgi_request_generated_tokens_sum",)),
)
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "e2e": ("tgi_request_duration",),
    "generation_tokens": ("tgi_request_generated_tokens",),
}
VERSION_HINT = "tgi 3.x router (no KV occupancy; batch_current_max_tokens is a reservation)"


def detect(expo: Exposition) -> bool:
    return expo.has_prefix(PREFIX)


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    view = RankView(expo, {})
    scrape = Scrape(replica, BACKEND, scraped_at, VERSION_HINT)
    success, failure = view.value("tgi_request_success"), view.value("tgi_request_failure")
    finished = tuple((reason, v) for reason, v in (("success", success), ("error", failure)) if v is not None)
    return [
        scrape.sample(
            finished_requests_total=finished,
            histograms=read_histograms(view, HISTOGRAMS),
            **read_fields(view, FIELDS),
        )
    ]
