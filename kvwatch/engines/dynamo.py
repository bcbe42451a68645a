"""NVIDIA Dynamo pages that are not an engine's own.

* **Frontend** (``dynamo_frontend_*``, Rust, HTTP port): one sample per served ``model`` (the label's
  case differs between families, so models are grouped case-insensitively). The frontend sees queues,
  not KV: ``requests_waiting`` = ``queued_requests`` (waiting for a first token), ``requests_running`` =
  active - queued (streaming past the first token). Block size and KV blocks are the workers' runtime
  config, not one pool, so no capacity is claimed.
* **Worker KV stats** without engine pass-through (``dynamo_component_kvstats_*`` Jan-2026 names,
  ``dynamo_component_{total_blocks,gpu_cache_usage_percent}`` 1.6 names): one sample per (model, dp_rank).
  The usage ratio is active over total blocks where both are on the page: Dynamo's TRT-LLM publisher
  computes its percent gauge from ``allocTotalBlocks``, which is cumulative, so it grows past 1 and
  stays there. Where only the gauge is, a value outside 0..1 is no usage at all (None).
* **KVBM** (``kvbm_*``, port 6880): block counters per transfer direction, mapped to plain tiers.
  KVBM's direction words mean different things per verb (offload ``h2d`` is host->disk, onboard ``h2d``
  is host->GPU), so the mapping is a table, below. Units are blocks, not bytes.

A Dynamo *worker* page that carries ``vllm:``/``sglang:``/``trtllm_`` families is that engine's for
KV purposes (``registry`` tries the engine adapters first): the engine families are the source of
truth and the ``dynamo_component_*`` copies are ignored there.
"""

from __future__ import annotations

from kvwatch.engines.base import (
    Field,
    RankView,
    Scrape,
    VersionHint,
    as_int,
    rank_keys,
    rank_views,
    read_fields,
    read_histograms,
    traffic,
    version_hint,
)
from kvwatch.engines.exposition_parser import Exposition, Labels
from kvwatch.model import ReplicaSample

BACKEND = "dynamo"
FRONTEND = "dynamo_frontend_"

#: KVBM counter -> (src tier, dst tier). G1=GPU, G2=host, G3=disk, G4=object.
KVBM_BLOCKS: dict[str, tuple[str, str]] = {
    "kvbm_offload_blocks_d2h": ("gpu", "host"),
    "kvbm_offload_blocks_h2d": ("host", "disk"),  # "h2d" = host-to-disk when offloading
    "kvbm_offload_blocks_d2d": ("gpu", "disk"),
    "kvbm_offload_blocks_d2o": ("gpu", "object"),
    "kvbm_onboard_blocks_h2d": ("host", "gpu"),  # "h2d" = host-to-device when onboarding
    "kvbm_onboard_blocks_d2d": ("disk", "gpu"),
    "kvbm_onboard_blocks_o2d": ("object", "gpu"),
}
KVBM_BYTES: dict[str, tuple[str, str]] = {
    "kvbm_offload_bytes_object": ("gpu", "object"),
    "kvbm_onboard_bytes_object": ("object", "gpu"),
}

FRONTEND_FIELDS: tuple[Field, ...] = (
    Field("requests_waiting", ("dynamo_frontend_queued_requests",)),
    Field("generation_tokens_total", ("dynamo_frontend_output_tokens_total",)),
)
FRONTEND_ACTIVE = ("dynamo_frontend_active_requests", "dynamo_frontend_inflight_requests")
FRONTEND_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("dynamo_frontend_time_to_first_token_seconds",),
    "itl": ("dynamo_frontend_inter_token_latency_seconds",),
    "e2e": ("dynamo_frontend_request_duration_seconds",),
    "generation_tokens": ("dynamo_frontend_output_sequence_tokens",),
}

KVSTATS_FIELDS: tuple[Field, ...] = (
    Field(
        "kv_usage_ratio",
        ("dynamo_component_gpu_cache_usage_percent", "dynamo_component_kvstats_gpu_cache_usage_percent"),
    ),
    Field("kv_used_blocks", ("dynamo_component_kvstats_active_blocks",)),
    Field("num_gpu_blocks", ("dynamo_component_total_blocks", "dynamo_component_kvstats_total_blocks")),
)
KVSTATS_ANCHORS = tuple(n for f in KVSTATS_FIELDS for n in f.names)

VERSION_HINTS: tuple[VersionHint, ...] = (
    VersionHint(("dynamo_component_gpu_cache_usage_percent",), (), "dynamo>=1.6 (component KV stats)"),
    VersionHint(("dynamo_component_kvstats_total_blocks",), (), "dynamo 0.7-0.8 (kvstats_* names)"),
    VersionHint(("dynamo_frontend_active_requests",), (), "dynamo frontend (active_requests)"),
    VersionHint(("dynamo_frontend_inflight_requests",), (), "dynamo frontend (older: inflight_requests)"),
)


def detect(expo: Exposition) -> bool:
    return (
        expo.has_prefix(FRONTEND)
        or any(expo.has(n) for n in KVBM_BLOCKS)
        or any(expo.has(n) for n in KVSTATS_ANCHORS)
    )


class _ModelView(RankView):
    """Frontend families label the model as ``model``, in varying case."""

    def matches(self, labels: Labels, shared: bool = False) -> bool:
        model = labels.get("model")
        return model is None or model.lower() == self.key["model"]

    def _candidates(self, name: str) -> list[tuple[Labels, float]]:
        """Every series of ``name``: the exact-value index cannot match a spelling in another case."""
        return self.expo.series(name)


def _frontend_models(expo: Exposition) -> dict[str, str]:
    """lower-cased model -> the first spelling seen."""
    models: dict[str, str] = {}
    for fam in expo:
        if fam.name.startswith(FRONTEND):
            for _, labels, _ in fam.samples:
                if "model" in labels:
                    models.setdefault(labels["model"].lower(), labels["model"])
    return models


def _frontend(expo: Exposition, scrape: Scrape) -> list[ReplicaSample]:
    out = []
    for lower, model in sorted(_frontend_models(expo).items()):
        view = _ModelView(expo, {"model": lower})
        values = read_fields(view, FRONTEND_FIELDS)
        active = view.value(*FRONTEND_ACTIVE)
        queued = values["requests_waiting"]
        out.append(
            scrape.sample(
                model_name=model,
                block_size=as_int(view.value("dynamo_frontend_model_kv_cache_block_size")),
                num_gpu_blocks=as_int(view.value("dynamo_frontend_model_total_kv_blocks")),
                requests_running=max(active - queued, 0.0)
                if active is not None and queued is not None
                else None,
                finished_requests_total=view.by_label("dynamo_frontend_requests_total", "status"),
                histograms=read_histograms(view, FRONTEND_HISTOGRAMS),
                **values,
            )
        )
    return out


def _kvstats(expo: Exposition, scrape: Scrape) -> list[ReplicaSample]:
    keys = rank_keys(expo, KVSTATS_ANCHORS, "dp_rank", model_label="model")
    out = []
    for model, dp_rank, view in rank_views(expo, keys, "dp_rank", model_label="model"):
        values = read_fields(view, KVSTATS_FIELDS)
        blocks = as_int(values.pop("num_gpu_blocks"))
        values["kv_usage_ratio"] = _usage(values["kv_usage_ratio"], values["kv_used_blocks"], blocks)
        out.append(
            scrape.sample(
                model_name=model,
                dp_rank=None if dp_rank in (None, "none") else dp_rank,
                num_gpu_blocks=blocks,
                **values,
            )
        )
    return out


def _usage(gauge: float | None, active: float | None, blocks: int | None) -> float | None:
    """Active over total blocks, else the percent gauge where it is a ratio at all (module doc)."""
    if active is not None and blocks:
        return active / blocks
    return gauge if gauge is not None and 0.0 <= gauge <= 1.0 else None


def _kvbm(expo: Exposition, scrape: Scrape) -> list[ReplicaSample]:
    if not any(expo.has(n) for n in (*KVBM_BLOCKS, *KVBM_BYTES)):
        return []
    view = RankView(expo, {})
    tiers = [
        traffic("kvbm", src, dst, blocks_total=view.value(name)) for name, (src, dst) in KVBM_BLOCKS.items()
    ]
    tiers += [
        traffic("kvbm", src, dst, bytes_total=view.value(name)) for name, (src, dst) in KVBM_BYTES.items()
    ]
    return [
        scrape.sample(
            version_hint="dynamo KVBM (block counters, no labels)",
            tier_traffic=tuple(t for t in tiers if t is not None),
        )
    ]


def parse(expo: Exposition, replica: str, scraped_at: float) -> list[ReplicaSample]:
    scrape = Scrape(replica, BACKEND, scraped_at, version_hint(expo, VERSION_HINTS, "dynamo"))
    return [*_frontend(expo, scrape), *_kvstats(expo, scrape), *_kvbm(expo, scrape)]


def notes(expo: Exposition) -> list[str]:
    out = []
    if expo.has_prefix(FRONTEND):
        out.append("Dynamo frontend: queue view per model; KV occupancy lives on the workers' pages")
    if any(expo.has(n) for n in KVBM_BLOCKS):
        out.append("KVBM counts blocks (engine block size), not bytes")
    return out
