"""Agent configuration: YAML file + ``KVWATCH_*`` environment overrides, validated with key paths.

Every error names the key path (``replicas[1].metrics_url``) and what was expected, and all errors
are reported at once so a user fixes a config in one pass (``kvwatch check-config``).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from kvwatch.model import BACKENDS, LengthBands, ReplicaSample

ENV_PREFIX = "KVWATCH_"
DEFAULT_LISTEN = "0.0.0.0:9477"
#: Most values a YAML document may stand for once its aliases are expanded (a config has hundreds).
MAX_YAML_NODES = 100_000
#: Longest quotation of a given value in an error message, in characters.
QUOTE_LIMIT = 80


class ConfigError(ValueError):
    """One or more configuration problems, each as ``(key_path, reason)``."""

    def __init__(self, problems: list[tuple[str, str]], source: str = "config"):
        self.problems = problems
        self.source = source
        lines = [f"{source}: {len(problems)} problem(s)"]
        lines += [f"  {path}: {reason}" for path, reason in problems]
        super().__init__("\n".join(lines))


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    name: str
    metrics_url: str
    backend: str = "auto"
    api_url: str | None = None
    proxy_listen: HostPort | None = None
    slots_url: str | None = None  # llama.cpp /slots; derived from metrics_url when backend is llamacpp
    model_name: str | None = None  # the served model name(s) the proxy accepts as labels
    gpus: tuple[str, ...] = ()  # GPU indexes or UUIDs; empty = map by PID / leave unmapped
    pid: int | None = None
    pid_file: str | None = None
    scrape_timeout_s: float | None = None
    #: KV bytes per token on one GPU, when the engine does not say (overrides what it says)
    kv_bytes_per_token: float | None = None


@dataclass(frozen=True, slots=True)
class IntervalsConfig:
    engine_s: float = 5.0
    gpu_s: float = 5.0
    slots_s: float = 5.0
    process_map_s: float = 30.0


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    timeout_s: float = 3.0
    max_response_bytes: int = 16 * 1024 * 1024
    backoff_max_s: float = 60.0
    # an engine page is outsider input: limits on what one page may cost (engines/exposition_parser.py)
    max_line_length: int = 16 * 1024  # characters; a longer line makes the page malformed
    max_series: int = 100_000  # series per page (Prometheus' sample_limit); more: the scrape fails
    max_label_values: int = 256  # distinct values of one label per page; more fold into "other"
    max_ranks: int = 128  # distinct data-parallel ranks (engine, dp_rank) per page; more fold into "other"
    parse_budget_s: float = 5.0  # CPU time one page may take to parse (in slices on the event loop)


@dataclass(frozen=True, slots=True)
class NvmlConfig:
    enabled: bool = True
    fake_gpus: int = 0  # >0: use the fake NVML backend with this many GPUs (demo, tests)
    events: bool = True  # XID / health event thread


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    max_body_bytes: int = 8 * 1024 * 1024
    client_header_timeout_s: float = 10.0  # slow-loris guard: headers + body must arrive in this time
    # an idle keep-alive client connection is closed after this; longer than client pools keep theirs
    # (httpx/openai 5 s, aiohttp 15 s) so that a client rarely sends a request on a closing connection
    client_keepalive_timeout_s: float = 75.0
    upstream_connect_timeout_s: float = 10.0
    upstream_read_timeout_s: float = 600.0
    models: tuple[str, ...] = ()  # accepted model_name label values beyond each replica's model_name
    inject_usage: bool = True  # ask streams for their usage chunk (stream_options.include_usage)
    max_buffered_bytes: int = 64 * 1024 * 1024  # request bytes all of a proxy's clients may buffer at once
    max_connections: int = 1024  # client connections per proxy; more are answered 503 and closed


@dataclass(frozen=True, slots=True)
class OtlpConfig:
    listen: HostPort | None = None  # e.g. 127.0.0.1:4318; None = off
    replica: str | None = None  # replica the spans belong to (when one engine sends to this agent)
    max_body_bytes: int = 16 * 1024 * 1024  # as sent (compressed)
    max_decompressed_bytes: int = 64 * 1024 * 1024  # inflated, checked while inflating


@dataclass(frozen=True, slots=True)
class SglangFilesConfig:
    replica: str
    directory: str
    poll_s: float = 1.0


@dataclass(frozen=True, slots=True)
class VllmPluginSocketConfig:
    """One replica's socket for kvwatch's vLLM stat-logger plugin (the engine's KVWATCH_VLLM_SOCKET)."""

    replica: str
    path: str


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    path: str | None = None  # None = off
    max_bytes: int = 64 * 1024 * 1024
    backups: int = 4


@dataclass(frozen=True, slots=True)
class KubernetesDiscoveryConfig:
    """``discovery.kubernetes``: engine pods on this node, listed and watched through the API server."""

    enabled: bool = False
    #: API server base URL; None = in-cluster (``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT``)
    api_url: str | None = None
    token_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/token"
    ca_file: str | None = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
    recognise: bool = True  # vLLM, SGLang, KServe and llm-d pods without kvwatch.io annotations
    watch_timeout_s: float = 300.0  # the server ends each watch after this (timeoutSeconds)
    backoff_max_s: float = 30.0
    max_event_bytes: int = 4 * 1024 * 1024  # one watch event (one pod as JSON); etcd caps objects at 1.5 MB
    max_list_bytes: int = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PodResourcesConfig:
    """``discovery.pod_resources``: which containers hold which GPUs, from the kubelet (no hostPID)."""

    enabled: bool = False
    socket: str = "/var/lib/kubelet/pod-resources/kubelet.sock"
    resource_names: tuple[str, ...] = ("nvidia.com/gpu",)
    interval_s: float = 15.0
    timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    kubernetes: KubernetesDiscoveryConfig = field(default_factory=KubernetesDiscoveryConfig)
    pod_resources: PodResourcesConfig = field(default_factory=PodResourcesConfig)


@dataclass(frozen=True, slots=True)
class Config:
    replicas: tuple[ReplicaConfig, ...] = ()
    listen: HostPort = field(default_factory=lambda: parse_host_port(DEFAULT_LISTEN))
    node: str = field(default_factory=socket.gethostname)
    length_bands: LengthBands = field(default_factory=LengthBands)
    intervals: IntervalsConfig = field(default_factory=IntervalsConfig)
    scrape: ScrapeConfig = field(default_factory=ScrapeConfig)
    nvml: NvmlConfig = field(default_factory=NvmlConfig)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    otlp: OtlpConfig = field(default_factory=OtlpConfig)
    sglang_request_files: tuple[SglangFilesConfig, ...] = ()
    vllm_plugin_sockets: tuple[VllmPluginSocketConfig, ...] = ()
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    log_level: str = "info"
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)

    def replica(self, name: str) -> ReplicaConfig | None:
        return next((r for r in self.replicas if r.name == name), None)

    def kv_bytes_per_token(self, sample: ReplicaSample) -> float | None:
        """KV bytes per token on one GPU: ``replicas[].kv_bytes_per_token`` where set, else the engine's."""
        replica = self.replica(sample.replica)
        if replica is not None and replica.kv_bytes_per_token is not None:
            return replica.kv_bytes_per_token
        return sample.kv_bytes_per_token

    @property
    def known_models(self) -> frozenset[str]:
        """Model names the proxy may use as label values; anything else folds into ``other``."""
        names = {r.model_name for r in self.replicas if r.model_name}
        return frozenset(names | set(self.proxy.models))


# --------------------------------------------------------------------------------------------
# parsing helpers
# --------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3,
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")


def parse_host_port(value: str) -> HostPort:
    """``HOST:PORT`` or ``:PORT`` (all interfaces); IPv6 as ``[::1]:PORT``."""
    text = str(value).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        raise ValueError(f"expected HOST:PORT, got {quoted(text)}")
    host = host.strip("[]") or "0.0.0.0"
    try:
        num = int(port)
    except ValueError:
        raise ValueError(f"port must be a number in {quoted(text)}") from None
    if not 0 <= num <= 65535:
        raise ValueError(f"port {num} out of range 0..65535")
    return HostPort(host, num)


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string like ``500ms``, ``5s``, ``2m``."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 5s or 500ms")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"expected a duration such as 5s or 500ms, got {quoted(value)}")
        seconds = float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m.group(2)]
    if seconds <= 0:
        raise ValueError(f"duration must be positive, got {quoted(value)}")
    return seconds


def parse_size(value: Any) -> int:
    """Bytes from a number or a string like ``16MiB``."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 16MiB")
    if isinstance(value, int | float):
        size = int(value)
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"expected a size such as 16MiB or 1000000, got {quoted(value)}")
        size = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if size <= 0:
        raise ValueError(f"size must be positive, got {quoted(value)}")
    return size


def _http_url(value: Any) -> str:
    text = str(value)
    parsed = urlparse(text)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"expected an http(s) URL, got {quoted(text)}")
    return text


class KeyPathReader:
    """Walks a YAML mapping, collecting every problem with its key path (also reads the SLO file)."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def problem(self, path: str, reason: str) -> None:
        self.problems.append((path, reason))

    def mapping(self, node: Any, path: str, allowed: set[str]) -> Mapping[str, Any]:
        if node is None:
            return {}
        if not isinstance(node, Mapping):
            self.problem(path or "(top level)", f"expected a mapping, got {type(node).__name__}")
            return {}
        for key in node:
            if key not in allowed:
                hint = ", ".join(sorted(allowed))
                self.problem(_join(path, brief(str(key))), f"unknown key (known keys: {hint})")
        return node

    def get(self, node: Mapping[str, Any], key: str, path: str, conv: Callable[[Any], Any],
            default: Any = None, required: bool = False) -> Any:
        if key not in node or node[key] is None:
            if required:
                self.problem(_join(path, key), "required")
            return default
        try:
            return conv(node[key])
        except (ValueError, TypeError) as exc:
            self.problem(_join(path, key), str(exc))
            return default


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _positive_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a non-negative integer, got {quoted(value)}")
    return value


def _at_least_one(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected an integer of at least 1, got {quoted(value)}")
    return value


def _count_limit(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"expected a whole number of at least 1, got {quoted(value)}")
    return value


def _positive_number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
        raise ValueError(f"expected a positive number, got {quoted(value)}")
    return float(value)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes", "on"):
        return True
    if str(value).lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {quoted(value)}")


def short_name(value: Any) -> str:
    """A replica, node or SLO name: a label value short and plain enough for any config or query."""
    text = str(value)
    if not _NAME.match(text):
        raise ValueError(f"expected a short name of letters, digits, '_', '.', '-', got {quoted(text)}")
    return text


def _backend(value: Any) -> str:
    text = str(value).lower()
    if text != "auto" and text not in BACKENDS:
        raise ValueError(f"unknown backend {quoted(text)} (one of auto, {', '.join(BACKENDS)})")
    return text


def _gpus(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of GPU indexes or UUIDs")
    return tuple(str(v) for v in value)


def _edges(value: Any) -> LengthBands:
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of ascending token counts, e.g. [1000, 5000, 10000, 20000]")
    try:
        edges = tuple(int(v) for v in value)
    except (TypeError, ValueError):
        raise ValueError(f"edges must be integers, got {quoted(value)}") from None
    return LengthBands(edges)


def _str_tuple(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        raise ValueError("expected a list of strings")
    return tuple(str(v) for v in value)


def _log_level(value: Any) -> str:
    text = str(value).lower()
    if text not in ("debug", "info", "warning", "error"):
        raise ValueError(f"expected debug, info, warning or error, got {quoted(value)}")
    return text


# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------

_REPLICA_KEYS = {
    "name", "backend", "metrics_url", "api_url", "proxy_listen", "slots_url", "model_name", "gpus",
    "pid", "pid_file", "scrape_timeout", "kv_bytes_per_token",
}


def _replica(r: KeyPathReader, node: Any, path: str) -> ReplicaConfig | None:
    m = r.mapping(node, path, _REPLICA_KEYS)
    if not m:
        if node is not None and isinstance(node, Mapping):
            r.problem(path, "empty replica: needs at least name and metrics_url")
        return None
    # Read every key before deciding whether the replica is usable, so one run reports them all.
    name = r.get(m, "name", path, short_name, required=True)
    metrics_url = r.get(m, "metrics_url", path, _http_url, required=True)
    backend = r.get(m, "backend", path, _backend, default="auto")
    api_url = r.get(m, "api_url", path, _http_url)
    proxy_listen = r.get(m, "proxy_listen", path, parse_host_port)
    if proxy_listen is not None and api_url is None:
        r.problem(_join(path, "proxy_listen"), "needs api_url: the engine's OpenAI base URL to forward to")
    rest = {
        "slots_url": r.get(m, "slots_url", path, _http_url),
        "model_name": r.get(m, "model_name", path, str),
        "gpus": r.get(m, "gpus", path, _gpus, default=()),
        "pid": r.get(m, "pid", path, _positive_int),
        "pid_file": r.get(m, "pid_file", path, str),
        "scrape_timeout_s": r.get(m, "scrape_timeout", path, parse_duration),
        "kv_bytes_per_token": r.get(m, "kv_bytes_per_token", path, _positive_number),
    }
    if name is None or metrics_url is None:
        return None
    return ReplicaConfig(name=name, metrics_url=metrics_url, backend=backend,
                         api_url=api_url.rstrip("/") if api_url else None, proxy_listen=proxy_listen, **rest)


def _section(r: KeyPathReader, top: Mapping[str, Any], key: str, cls: type, spec: dict[str, tuple[str, Any]],
             parent: str = ""):
    """Read a flat section: ``spec`` maps YAML key -> (dataclass field, converter)."""
    path = _join(parent, key)
    node = r.mapping(top.get(key), path, set(spec))
    defaults = cls()
    values = {}
    for yaml_key, (attr, conv) in spec.items():
        values[attr] = r.get(node, yaml_key, path, conv, default=getattr(defaults, attr))
    return cls(**values)


_TOP_KEYS = {
    "replicas", "listen", "node", "length_bands", "intervals", "scrape", "nvml", "proxy", "otlp",
    "sglang_request_files", "vllm_plugin_sockets", "ledger", "log_level", "discovery",
}


def _api_url(value: Any) -> str:
    return _http_url(value).rstrip("/")


def _discovery(r: KeyPathReader, top: Mapping[str, Any]) -> DiscoveryConfig:
    node = r.mapping(top.get("discovery"), "discovery", {"kubernetes", "pod_resources"})
    kubernetes = _section(r, node, "kubernetes", KubernetesDiscoveryConfig, {
        "enabled": ("enabled", _bool),
        "api_url": ("api_url", _api_url),
        "token_file": ("token_file", str),
        "ca_file": ("ca_file", str),
        "recognise": ("recognise", _bool),
        "watch_timeout": ("watch_timeout_s", parse_duration),
        "backoff_max": ("backoff_max_s", parse_duration),
        "max_event_bytes": ("max_event_bytes", parse_size),
        "max_list_bytes": ("max_list_bytes", parse_size),
    }, parent="discovery")
    pod_resources = _section(r, node, "pod_resources", PodResourcesConfig, {
        "enabled": ("enabled", _bool),
        "socket": ("socket", str),
        "resource_names": ("resource_names", _str_tuple),
        "interval": ("interval_s", parse_duration),
        "timeout": ("timeout_s", parse_duration),
    }, parent="discovery")
    return DiscoveryConfig(kubernetes, pod_resources)


def config_from_mapping(data: Any, source: str = "config") -> Config:
    """Validate a parsed YAML document; raise ConfigError listing every problem."""
    r = KeyPathReader()
    top = r.mapping(data, "", _TOP_KEYS)

    replicas: list[ReplicaConfig] = []
    raw_replicas = top.get("replicas") or []
    if not isinstance(raw_replicas, list):
        r.problem("replicas", "expected a list of replicas")
        raw_replicas = []
    for i, node in enumerate(raw_replicas):
        rep = _replica(r, node, f"replicas[{i}]")
        if rep is not None:
            replicas.append(rep)
    seen: dict[str, int] = {}
    for i, rep in enumerate(replicas):
        if rep.name in seen:
            r.problem(f"replicas[{i}].name", f"duplicate replica name {rep.name!r}")
        seen[rep.name] = i
    listens = [(rep.name, rep.proxy_listen) for rep in replicas if rep.proxy_listen]
    ports = [hp.port for _, hp in listens if hp.port]
    if len(ports) != len(set(ports)):
        r.problem("replicas", "two replicas use the same proxy_listen port")

    intervals = _section(r, top, "intervals", IntervalsConfig, {
        "engine": ("engine_s", parse_duration),
        "gpu": ("gpu_s", parse_duration),
        "slots": ("slots_s", parse_duration),
        "process_map": ("process_map_s", parse_duration),
    })
    scrape = _section(r, top, "scrape", ScrapeConfig, {
        "timeout": ("timeout_s", parse_duration),
        "max_response_bytes": ("max_response_bytes", parse_size),
        "backoff_max": ("backoff_max_s", parse_duration),
        "max_line_length": ("max_line_length", parse_size),
        "max_series": ("max_series", _count_limit),
        "max_label_values": ("max_label_values", _count_limit),
        "max_ranks": ("max_ranks", _count_limit),
        "parse_budget": ("parse_budget_s", parse_duration),
    })
    nvml = _section(r, top, "nvml", NvmlConfig, {
        "enabled": ("enabled", _bool),
        "fake_gpus": ("fake_gpus", _positive_int),
        "events": ("events", _bool),
    })
    proxy = _section(r, top, "proxy", ProxyConfig, {
        "max_body_bytes": ("max_body_bytes", parse_size),
        "client_header_timeout": ("client_header_timeout_s", parse_duration),
        "client_keepalive_timeout": ("client_keepalive_timeout_s", parse_duration),
        "upstream_connect_timeout": ("upstream_connect_timeout_s", parse_duration),
        "upstream_read_timeout": ("upstream_read_timeout_s", parse_duration),
        "models": ("models", _str_tuple),
        "inject_usage": ("inject_usage", _bool),
        "max_buffered_bytes": ("max_buffered_bytes", parse_size),
        "max_connections": ("max_connections", _at_least_one),
    })
    if proxy.max_buffered_bytes < proxy.max_body_bytes:
        r.problem("proxy.max_buffered_bytes", f"must be at least proxy.max_body_bytes "
                  f"({proxy.max_body_bytes}), or a body within that limit could never be buffered")
    otlp = _section(r, top, "otlp", OtlpConfig, {
        "listen": ("listen", parse_host_port),
        "replica": ("replica", short_name),
        "max_body_bytes": ("max_body_bytes", parse_size),
        "max_decompressed_bytes": ("max_decompressed_bytes", parse_size),
    })
    if otlp.max_decompressed_bytes < otlp.max_body_bytes:
        r.problem("otlp.max_decompressed_bytes", f"must be at least otlp.max_body_bytes "
                  f"({otlp.max_body_bytes}), or an uncompressed export within that limit would be refused")
    if otlp.replica is not None and otlp.replica not in seen:
        r.problem("otlp.replica", f"no replica named {otlp.replica!r}")
    ledger = _section(r, top, "ledger", LedgerConfig, {
        "path": ("path", str),
        "max_bytes": ("max_bytes", parse_size),
        "backups": ("backups", _positive_int),
    })

    files: list[SglangFilesConfig] = []
    raw_files = top.get("sglang_request_files") or []
    if not isinstance(raw_files, list):
        r.problem("sglang_request_files", "expected a list of {replica, directory}")
        raw_files = []
    for i, node in enumerate(raw_files):
        path = f"sglang_request_files[{i}]"
        m = r.mapping(node, path, {"replica", "directory", "poll"})
        rep_name = r.get(m, "replica", path, short_name, required=True)
        directory = r.get(m, "directory", path, str, required=True)
        if rep_name is not None and rep_name not in seen:
            r.problem(_join(path, "replica"), f"no replica named {rep_name!r}")
        if rep_name and directory:
            files.append(SglangFilesConfig(rep_name, directory, r.get(m, "poll", path, parse_duration, 1.0)))

    discovery = _discovery(r, top)
    plugin_sockets = _plugin_sockets(r, top.get("vllm_plugin_sockets"), seen)

    cfg = Config(
        discovery=discovery,
        replicas=tuple(replicas),
        listen=r.get(top, "listen", "", parse_host_port, default=parse_host_port(DEFAULT_LISTEN)),
        node=r.get(top, "node", "", short_name, default=socket.gethostname()),
        length_bands=r.get(top, "length_bands", "", _edges, default=LengthBands()),
        intervals=intervals,
        scrape=scrape,
        nvml=nvml,
        proxy=proxy,
        otlp=otlp,
        sglang_request_files=tuple(files),
        vllm_plugin_sockets=plugin_sockets,
        ledger=ledger,
        log_level=r.get(top, "log_level", "", _log_level, default="info"),
    )
    if r.problems:
        raise ConfigError(r.problems, source)
    return cfg


def _plugin_sockets(r: KeyPathReader, raw: Any,
                    replicas: Mapping[str, int]) -> tuple[VllmPluginSocketConfig, ...]:
    """``vllm_plugin_sockets: [{replica, path}]``: one socket per replica, one replica per socket."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        r.problem("vllm_plugin_sockets", "expected a list of {replica, path}")
        return ()
    out: list[VllmPluginSocketConfig] = []
    for i, node in enumerate(raw):
        path = f"vllm_plugin_sockets[{i}]"
        m = r.mapping(node, path, {"replica", "path"})
        rep_name = r.get(m, "replica", path, short_name, required=True)
        sock = r.get(m, "path", path, _socket_path, required=True)
        if rep_name is not None and rep_name not in replicas:
            r.problem(_join(path, "replica"), f"no replica named {rep_name!r}")
        elif rep_name in {s.replica for s in out}:
            r.problem(_join(path, "replica"), f"replica {rep_name!r} already has a socket")
        if sock is not None and sock in {s.path for s in out}:
            r.problem(_join(path, "path"), f"{sock!r} is already another replica's socket")
        if rep_name and sock:
            out.append(VllmPluginSocketConfig(rep_name, sock))
    return tuple(out)


def _socket_path(value: Any) -> str:
    text = str(value)
    if not text.startswith("/"):
        raise ValueError(f"expected an absolute path for a Unix socket, got {quoted(text)}")
    if len(text.encode()) > 107:
        raise ValueError("a Unix socket path is at most 107 bytes")
    return text


def apply_env_overrides(data: dict[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """``KVWATCH_LISTEN=:9000``, ``KVWATCH_INTERVALS__ENGINE=2s``: ``__`` separates nesting.

    Values are read as YAML scalars (``true``, ``5``, ``[1000, 5000]``). An empty value means the
    variable is unset (the file's value stays: ``KVWATCH_LISTEN=`` never means all interfaces).
    Replica entries cannot be addressed this way; they live in the file. ConfigError names the
    variable of every problem found here.
    """
    out = dict(data)
    problems: list[tuple[str, str]] = []
    for name, raw in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name == "KVWATCH_CONFIG":
            continue
        parts = [p.lower() for p in name[len(ENV_PREFIX):].split("__") if p]
        if not parts or not raw.strip():
            continue
        if parts[0] in ("replicas", "sglang_request_files") and len(parts) > 1:
            problems.append((name, f"{parts[0]} entries cannot be set from the environment; "
                                   "list them in the config file"))
            continue
        try:
            value = safe_load(raw)
        except yaml.YAMLError as exc:
            problems.append((name, f"not a valid YAML value: {brief(str(getattr(exc, 'problem', exc)))}"))
            continue
        node = out
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, Mapping) else {}
            node[part] = child
            node = child
        node[parts[-1]] = value
    if problems:
        raise ConfigError(problems, "environment")
    return out


def brief(text: str, limit: int = QUOTE_LIMIT) -> str:
    """Cut ``text`` to ``limit`` characters, so no error message grows with the input."""
    return text if len(text) <= limit else text[:limit] + "…"


def quoted(value: Any) -> str:
    """``repr(value)`` cut to QUOTE_LIMIT characters: how error messages quote what they were given."""
    return brief(repr(value))


class BoundedSafeLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document whose aliases expand past MAX_YAML_NODES nodes.

    Aliases share one node, so a 400-byte "billion laughs" file parses small but expands to ~10^9
    values the moment anything walks or quotes it. The expanded size is counted on the node graph
    (each node once, memoised), in time linear in the file, before anything is constructed.
    """

    def compose_document(self) -> Any:
        node = super().compose_document()
        _expanded_size(node)
        return node


def _expanded_size(root: yaml.Node) -> int:
    """Nodes ``root`` stands for once every alias is expanded; YAMLError past MAX_YAML_NODES."""
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    on_path: set[int] = set()
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[key] > MAX_YAML_NODES:
                raise yaml.YAMLError(f"aliases expand to more than {MAX_YAML_NODES} values")
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise yaml.YAMLError("recursive alias (refers to the node that holds it)")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node) if id(child) not in sizes)
    return sizes[id(root)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def safe_load(text: str) -> Any:
    """``yaml.safe_load`` with alias expansion bounded (BoundedSafeLoader)."""
    return yaml.load(text, Loader=BoundedSafeLoader)


def read_yaml_file(path: str | Path) -> Any:
    """Parse a YAML file; ConfigError names the file and the line of a syntax error."""
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([("(file)", f"cannot read: {exc.strerror or exc}")], source) from None
    try:
        return safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        reason = brief(str(getattr(exc, "problem", None) or exc))
        raise ConfigError([(where, f"not valid YAML: {reason}")], source) from None
    except RecursionError:
        raise ConfigError([("(file)", "not valid YAML: nested too deeply")], source) from None


def load_config(path: str | Path | None, environ: Mapping[str, str] | None = None) -> Config:
    """Read YAML (or start empty), apply ``KVWATCH_*`` overrides, validate."""
    environ = os.environ if environ is None else environ
    data: Any = {}
    source = "environment"
    if path is not None:
        source = str(path)
        data = read_yaml_file(path) or {}
    if not isinstance(data, dict):
        raise ConfigError([("(top level)", "expected a mapping of settings")], source)
    return config_from_mapping(apply_env_overrides(data, environ), source)
