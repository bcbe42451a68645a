"""LMCache's ``lmcache:*`` families -> TierTraffic.

LMCache runs inside vLLM's or SGLang's worker processes, so its families appear on the engine's own
page; the vLLM and SGLang adapters call ``tier_traffic``. Tiers in plain words:

* stored tokens (``num_stored_tokens``): GPU -> LMCache's first tier, host memory;
* retrieved tokens (``num_hit_tokens``): host -> GPU;
* remote backend bytes (``num_remote_write_bytes`` / ``num_remote_read_bytes``): host <-> remote.

Labels are ``model_name, worker_id`` (+ ``role``, ``served_model_name`` in newer releases), with no DP
rank, so LMCache traffic is attributed only when the page has a single engine rank (a view that is
not ``ranked``). Every TP worker
counts the same tokens (one shard each), so tokens are read from the lowest ``worker_id``; bytes are
per-shard and are summed over workers.
"""

from __future__ import annotations

import math

from kvwatch.engines.base import RankView, rank_sort_key
from kvwatch.engines.exposition_parser import Exposition, Labels
from kvwatch.model import TierTraffic

FAMILY = "lmcache"
PREFIX = "lmcache:"

#: (src, dst, exposed name, unit)
TRANSFERS: tuple[tuple[str, str, str, str], ...] = (
    ("gpu", "host", "lmcache:num_stored_tokens_total", "tokens"),
    ("host", "gpu", "lmcache:num_hit_tokens_total", "tokens"),
    ("host", "remote", "lmcache:num_remote_write_bytes_total", "bytes"),
    ("remote", "host", "lmcache:num_remote_read_bytes_total", "bytes"),
)


def present(expo: Exposition) -> bool:
    return any(expo.has(name) for _, _, name, _ in TRANSFERS)


def _model(labels: Labels) -> str | None:
    return labels.get("served_model_name") or labels.get("model_name")


def _series(expo: Exposition, name: str, model: str | None) -> list[tuple[Labels, float]]:
    found = [
        (lab, v)
        for lab, v in expo.series(name)
        if lab.get("role", "worker") == "worker" and not math.isnan(v)
    ]
    models = {_model(lab) for lab, _ in found}
    if len(models) > 1:  # several models on one page: keep this model's only
        found = [(lab, v) for lab, v in found if _model(lab) == model]
    return found


def tier_traffic(view: RankView, model: str | None) -> tuple[TierTraffic, ...]:
    """LMCache traffic of ``model``, one TierTraffic per direction; none for a view that is one of
    several ranks on its page."""
    if view.ranked:
        return ()
    out = []
    for src, dst, name, unit in TRANSFERS:
        found = _series(view.expo, name, model)
        if not found:
            continue
        if unit == "tokens":
            first = min(found, key=lambda s: rank_sort_key(s[0].get("worker_id")))
            out.append(TierTraffic(FAMILY, src, dst, tokens_total=first[1]))
        else:
            out.append(TierTraffic(FAMILY, src, dst, bytes_total=math.fsum(v for _, v in found)))
    return tuple(out)
