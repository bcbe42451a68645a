"""Pre-created request series carry the model label the records will carry: a proxied replica without
``model_name`` gets its series under the model the proxy learned from the engine, never a row of
zeros under ``other`` that no request of it will ever reach."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.config import Config, MetricsConfig
from kvwatch.export.requests import RequestCollector
from kvwatch.model import DEFAULT_BANDS, OUTCOMES, InFlightRequest, Outcome, RequestRecord
from kvwatch.requests.accounting import ModelLabels
from kvwatch.state import NodeState
from tests.configs import proxied_replica

SERVED = "Qwen/Qwen3-8B"
#: r0 proxied without model_name (the default), r1 proxied with one
CONFIG = Config(
    replicas=(
        proxied_replica("r0", 1),
        proxied_replica("r1", 2, model_name="tiny"),
    ),
    metrics=MetricsConfig("full"),
)
PROXY_FAMILIES = (
    "kvwatch_requests_total",
    "kvwatch_request_output_tokens_estimated_total",
    "kvwatch_request_preemption_stalls_total",
    "kvwatch_requests_in_flight",
    "kvwatch_in_flight_tokens",
)


def _served_label() -> str:
    """The label r0's proxy gives a request once it has learned the engine's model (as it does)."""
    labels = ModelLabels(CONFIG.known_models, CONFIG.replicas[0].model_name)
    labels.learn([SERVED])
    return labels.label(None)


def _series(state: NodeState) -> dict[tuple[str, str, str], list[float]]:
    """(family sample name, replica, model_name) -> values of the proxy families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RequestCollector(state, CONFIG))
    out: dict[tuple[str, str, str], list[float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name in PROXY_FAMILIES:
                out.setdefault((s.name, s.labels["replica"], s.labels["model_name"]), []).append(s.value)
    return out


def test_proxied_replica_without_model_name_has_no_other_series_only_the_served_models() -> None:
    model = _served_label()
    assert model == SERVED
    state = NodeState("n", DEFAULT_BANDS)
    assert {m for _name, replica, m in _series(state) if replica == "r0"} == set()  # its label unknown yet
    handle = state.in_flight.start(InFlightRequest("r0", model, "0-1k", 100, 0, 0.0, 512))
    running = _series(state)
    assert running[("kvwatch_requests_total", "r0", model)] == [0.0] * len(OUTCOMES) * len(
        DEFAULT_BANDS.all_names
    )
    state.in_flight.finish(handle)
    state.requests.observe(
        RequestRecord(
            replica="r0",
            model_name=model,
            source="proxy",
            outcome=Outcome.COMPLETED,
            started_at=0.0,
            output_tokens=200,
            ttft_seconds=0.1,
            e2e_seconds=2.0,
        )
    )
    done = _series(state)
    r0 = {(name, m) for name, replica, m in done if replica == "r0"}
    assert r0 == {(name, model) for name in PROXY_FAMILIES}
    assert sum(done[("kvwatch_requests_total", "r0", model)]) == 1
    assert done[("kvwatch_requests_in_flight", "r0", model)] == [0.0] * len(DEFAULT_BANDS.all_names)


def test_proxied_replica_with_model_name_is_pre_created_under_it() -> None:
    series = _series(NodeState("n", DEFAULT_BANDS))
    assert {(name, m) for name, replica, m in series if replica == "r1"} == {
        (name, "tiny") for name in PROXY_FAMILIES
    }
    assert all(v == 0 for values in series.values() for v in values)
