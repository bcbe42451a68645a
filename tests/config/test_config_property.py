"""Any value at any key: the config is read, or refused with problems that name that key.

The cases beside each key are hand-written (``test_config.py``); here hypothesis puts whatever YAML
can hold (null, booleans, huge and negative integers, NaN and infinities, strings, lists, mappings)
at one to three keys of a config with a replica, a proxy and an OTLP receiver. The only outcomes
allowed are a Config or a ConfigError whose every problem is at one of the keys that changed (or
at a key whose cross-key rule reads a changed one, ``READS``). Before
``jsonsafe.finite``, an integer too large for a float ended the read with an OverflowError.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvwatch.config import Config, ConfigError, config_from_mapping
from kvwatch.config.schema import ReplicaConfig
from kvwatch.config.validate import schema_fields
from tests.config.keys import leaf_keys

BASE: dict[str, Any] = {
    "listen": "127.0.0.1:9500",
    "otlp": {"listen": "127.0.0.1:4318"},
    "replicas": [
        {
            "name": "vllm-0",
            "metrics_url": "http://127.0.0.1:8000/metrics",
            "api_url": "http://127.0.0.1:8000",
            "proxy_listen": "127.0.0.1:8100",
            "model_name": "qwen3",
        }
    ],
}
#: every settable key: the sections' scalars, and each key of a replica entry
KEYS = sorted(
    {k for k in leaf_keys() if k != ("replicas",)}
    | {("replicas", 0, key) for key in schema_fields(ReplicaConfig)}
)

YAML_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([10**400, -(10**400), 0, -1, 65536, 2**63])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
    | st.sampled_from(
        ["5s", "0s", "-1s", "16MiB", "1" + "0" * 400 + "MiB", ":0", "[::1]:99999", "http://x/"]
    ),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


def _dotted(path: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else p for p in path).replace(".[", "[")


def _set(doc: dict, path: tuple, value: object) -> None:
    node: Any = doc
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[path[-1]] = value


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(KEYS), YAML_VALUES), min_size=1, max_size=3))
def test_any_value_at_any_key_is_read_or_named(changes: list[tuple[tuple, object]]) -> None:
    doc = copy.deepcopy(BASE)
    for path, value in changes:
        _set(doc, path, value)
    try:
        assert isinstance(config_from_mapping(doc), Config)
        event("read")
    except ConfigError as exc:
        event("refused")
        changed = {_dotted(path) for path, _ in changes}
        for key, reason in exc.problems:
            assert reason
            named = {key.split(" (")[0]} | READS.get(key, set())
            assert any(n.startswith(c) or c.startswith(n) for n in named for c in changed), (
                key,
                reason,
                changed,
            )


#: the checks across keys (config/loader.py ``_cross_checks``) name their own key: the keys each reads
READS = {
    "proxy.max_buffered_bytes": {"proxy.max_body_bytes"},
    "otlp.max_decompressed_bytes": {"otlp.max_body_bytes"},
    "otlp.replica": {"replicas[0].name"},
    "replicas[0].proxy_listen": {"replicas[0].api_url"},
}
