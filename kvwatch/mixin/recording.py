"""Recording rules that do not depend on the SLO file, in two levels (docs/alerting.md).

* ``kvwatch-node.recording``: per replica / per GPU; every label of the raw series is kept
  (``sum without (...)``), so these can run in any Prometheus that scrapes the node.
* ``kvwatch-fleet.recording``: across nodes, grouped by ``cluster`` and ``model_name``; these need
  every node of a fleet in the Prometheus that evaluates them (ratios cannot be re-aggregated
  after federation).

Each group goes to the rule file of its level (``kvwatch/mixin/rules.py``).
"""

from __future__ import annotations

from kvwatch.mixin.promql import FLEET_LABELS, by, eq, ne, one_of, selector
from kvwatch.mixin.rulefile import Group, Recording

#: outcomes that count as "completed" in the per-band completion ratio: a stop, or the token
#: budget the client asked for (docs/alerting.md)
COMPLETION_OUTCOMES = ("completed", "truncated")
OUTCOME_WINDOWS = ("5m", "1h")

_FLEET = FLEET_LABELS
_BAND = by((*_FLEET, "model_name", "length_band"))
_MODEL = by((*_FLEET, "model_name"))


def _or_zero(expr: str, like: str) -> str:
    """``expr``, or 0 for every series of ``like`` that ``expr`` lacks (so "none yet" reads 0)."""
    return f"(\n  {expr}\n  or\n  0 * {like}\n)"


# --------------------------------------------------------------------------------------------
# node level
# --------------------------------------------------------------------------------------------


def node_group() -> Group:
    gpu_side = selector("kvwatch_kv_tier_transfer_bytes_total", eq("src_tier", "gpu"), ne("dst_tier", "gpu"))
    to_gpu = selector("kvwatch_kv_tier_transfer_bytes_total", eq("dst_tier", "gpu"), ne("src_tier", "gpu"))
    link = "kvwatch:replica_pcie_link_max_bytes_per_second:sum"
    rules = (
        Recording("kvwatch:preemptions:rate5m", "rate(kvwatch_preemptions_total[5m])"),
        # tokens recomputed after preemption per token of useful work (prefill + decode); `source`
        # says engine-reported or estimated, and a replica reports one of them
        Recording(
            "kvwatch:recompute_waste:ratio_rate15m",
            "max without (source) (rate(kvwatch_recomputed_tokens_total[15m]))\n/\n"
            "(\n  rate(kvwatch_prompt_tokens_total[15m]) + rate(kvwatch_generation_tokens_total[15m])\n"
            "  > 0\n)",
        ),
        # KV bytes leaving the GPU (offload: device -> host/disk/remote) and coming back (onload),
        # per replica: the replica -> GPU map is per replica, so DP ranks are summed
        Recording(
            "kvwatch:kv_tier_offload_bytes:rate5m",
            f"sum without (dp_rank, family, src_tier, dst_tier) (rate({gpu_side}[5m]))",
        ),
        Recording(
            "kvwatch:kv_tier_onload_bytes:rate5m",
            f"sum without (dp_rank, family, src_tier, dst_tier) (rate({to_gpu}[5m]))",
        ),
        # one-direction PCIe bandwidth of the links of a replica's GPUs, via the replica -> GPU map
        Recording(
            link,
            "sum without (dp_rank, gpu, uuid, mapped_by) (\n"
            "  kvwatch_replica_gpu_info\n"
            "  * on (instance, uuid) group_left ()\n"
            "  kvwatch_gpu_pcie_link_max_bytes_per_second\n"
            ")",
        ),
        Recording(
            "kvwatch:kv_tier_pcie:ratio_rate5m",
            f"kvwatch:kv_tier_offload_bytes:rate5m\n/ ignoring (model_name, backend) group_left ()\n"
            f"({link} > 0)",
            (("direction", "offload"),),
        ),
        Recording(
            "kvwatch:kv_tier_pcie:ratio_rate5m",
            f"kvwatch:kv_tier_onload_bytes:rate5m\n/ ignoring (model_name, backend) group_left ()\n"
            f"({link} > 0)",
            (("direction", "onload"),),
        ),
    )
    return Group("kvwatch-node.recording", rules)


# --------------------------------------------------------------------------------------------
# fleet level
# --------------------------------------------------------------------------------------------


def _outcome_rules(window: str) -> list[Recording]:
    rate = f"kvwatch:requests:rate{window}"
    all_finished = f"sum without (outcome) ({rate})"
    done = f"sum without (outcome) ({selector(rate, one_of('outcome', COMPLETION_OUTCOMES))})"
    return [
        Recording(rate, f"sum by ({_BAND}, outcome) (rate(kvwatch_requests_total[{window}]))"),
        # share of each outcome among the band's finished requests: completion (completed),
        # truncation (truncated), abandonment (aborted), error, rejected
        Recording(
            f"kvwatch:request_outcome:ratio_rate{window}",
            f"{rate}\n/ ignoring (outcome) group_left ()\n({all_finished} > 0)",
        ),
        # requests that finished as asked (stop or the token budget) per finished request
        Recording(
            f"kvwatch:request_completion:ratio_rate{window}",
            f"{_or_zero(done, all_finished)}\n/\n({all_finished} > 0)",
        ),
    ]


def fleet_group() -> Group:
    no_queue = "kvwatch_kv_free_tokens and kvwatch_requests_waiting == 0"
    preempting = "rate(kvwatch_preemptions_total[5m]) > 0"
    # a queue that lasted (every scrape of the last minute), as derive/stranded.py counts it: one
    # request caught between arrival and admission would strand the free KV of every other replica
    queueing = "min_over_time(kvwatch_requests_waiting[1m]) > 0"
    under_pressure = f"count by ({_MODEL}) ({queueing})\n    or\n    count by ({_MODEL}) ({preempting})"
    stranded = (
        f"sum by ({_MODEL}) (\n"
        f"    ({no_queue})\n"
        f"    unless\n"
        f"    ({preempting})\n"
        f"  )\n"
        f"  and on ({_MODEL})\n"
        f"  (\n"
        f"    {under_pressure}\n"
        f"  )"
    )
    capacity = "kvwatch:kv_capacity_tokens:sum"
    rules = [rule for w in OUTCOME_WINDOWS for rule in _outcome_rules(w)]
    rules += [
        Recording(capacity, f"sum by ({_MODEL}) (kvwatch_kv_capacity_tokens)"),
        # free KV tokens on replicas with nothing waiting and no preemption, while another replica
        # of the same model (on any node) queues or preempts: memory data parallelism cannot pool
        Recording("kvwatch:kv_stranded_tokens:sum", _or_zero(stranded, capacity)),
        Recording("kvwatch:kv_stranded:ratio", f"kvwatch:kv_stranded_tokens:sum\n/\n({capacity} > 0)"),
    ]
    return Group("kvwatch-fleet.recording", tuple(rules))
