"""The agent's configuration schema: every YAML key, its kind, default, bounds and doc, declared once.

Each key lives in its field's metadata (``setting``, ``section``, ``entries`` in validate.py). The
validator reads files and ``KVWATCH_*`` overrides from it, and ``kvwatch docs`` renders
docs/config.md from it: no other module spells a key.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from kvwatch.config.validate import (
    BASE_URL,
    BOOL,
    DURATION,
    EDGES,
    HOST_PORT,
    INTEGER,
    NAME,
    PATH,
    PLUGIN_DIR,
    POSITIVE_NUMBER,
    SIZE,
    SOCKET_PATH,
    STRING,
    STRINGS,
    URL,
    WORD,
    WORKER_COUNT,
    HostPort,
    entries,
    parse_host_port,
    section,
    setting,
)
from kvwatch.model import BACKENDS, LengthBands, ReplicaSample

ENV_PREFIX = "KVWATCH_"
DEFAULT_LISTEN = "0.0.0.0:9477"
LOG_LEVELS = ("debug", "info", "warning", "error")
#: metrics.profile values: how much per-replica detail /metrics carries (docs/scale.md)
LEAN_PROFILE, FULL_PROFILE = "lean", "full"

__all__ = ["DEFAULT_LISTEN", "ENV_PREFIX", "HostPort"]


@dataclass(frozen=True, slots=True)
class ReplicaConfig:
    name: str = field(metadata=setting("name", NAME, "the replica's name: its `replica` label"))
    metrics_url: str = field(metadata=setting("metrics_url", URL, "the engine's Prometheus page"))
    backend: str = field(
        default="auto",
        metadata=setting(
            "backend", WORD, "the engine; `auto` recognises it from its page", choices=("auto", *BACKENDS)
        ),
    )
    api_url: str | None = field(
        default=None,
        metadata=setting("api_url", BASE_URL, "the engine's OpenAI base URL; the proxy forwards to it"),
    )
    proxy_listen: HostPort | None = field(
        default=None,
        metadata=setting(
            "proxy_listen",
            HOST_PORT,
            "where kvwatch's metering proxy for this replica listens (needs api_url)",
        ),
    )
    slots_url: str | None = field(
        default=None,
        metadata=setting(
            "slots_url", URL, "llama.cpp's /slots page; derived from metrics_url when backend is llamacpp"
        ),
    )
    model_name: str | None = field(
        default=None,
        metadata=setting("model_name", STRING, "the served model name the proxy accepts as a label value"),
    )
    gpus: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "gpus", STRINGS, "GPU indexes or UUIDs; empty: map by PID, or leave unmapped", shown_default="[]"
        ),
    )
    pid: int | None = field(
        default=None,
        metadata=setting("pid", INTEGER, "the engine's process id (maps it to its GPUs)", minimum=0),
    )
    pid_file: str | None = field(
        default=None, metadata=setting("pid_file", PATH, "a file holding the engine's process id")
    )
    scrape_timeout_s: float | None = field(
        default=None,
        metadata=setting("scrape_timeout", DURATION, "this replica's scrape timeout; unset: scrape.timeout"),
    )
    kv_bytes_per_token: float | None = field(
        default=None,
        metadata=setting(
            "kv_bytes_per_token",
            POSITIVE_NUMBER,
            "KV bytes per token on one GPU, when the engine does not say (overrides what it says)",
        ),
    )
    kv_capacity_tokens: int | None = field(
        default=None,
        metadata=setting(
            "kv_capacity_tokens",
            INTEGER,
            "the KV pool in tokens (per data-parallel rank), when the engine does not say it right "
            "(overrides what it says): llama-server started without -np shares one pool of its -c "
            "tokens among 4 slots, and /slots gives each slot the whole",
            minimum=1,
        ),
    )


@dataclass(frozen=True, slots=True)
class IntervalsConfig:
    engine_s: float = field(
        default=5.0, metadata=setting("engine", DURATION, "scrape every engine this often")
    )
    gpu_s: float = field(default=5.0, metadata=setting("gpu", DURATION, "poll NVML this often"))
    process_map_s: float = field(
        default=30.0,
        metadata=setting("process_map", DURATION, "refresh the GPU-process-to-replica mapping this often"),
    )


@dataclass(frozen=True, slots=True)
class ScrapeConfig:
    timeout_s: float = field(default=3.0, metadata=setting("timeout", DURATION, "one scrape's timeout"))
    max_response_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=setting(
            "max_response_bytes", SIZE, "an engine page may be at most this big (checked while reading)"
        ),
    )
    backoff_max_s: float = field(
        default=60.0,
        metadata=setting("backoff_max", DURATION, "longest wait between retries of a failing engine"),
    )
    max_line_length: int = field(
        default=16 * 1024,
        metadata=setting(
            "max_line_length", SIZE, "characters in one line of a page; a longer line makes it malformed"
        ),
    )
    max_series: int = field(
        default=100_000,
        metadata=setting(
            "max_series",
            INTEGER,
            "series per page (Prometheus' sample_limit); more: the scrape fails",
            minimum=1,
        ),
    )
    max_label_values: int = field(
        default=256,
        metadata=setting(
            "max_label_values",
            INTEGER,
            "distinct values of one label per page; more fold into `other`",
            minimum=1,
        ),
    )
    max_ranks: int = field(
        default=128,
        metadata=setting(
            "max_ranks", INTEGER, "distinct data-parallel ranks per page; more fold into `other`", minimum=1
        ),
    )
    parse_budget_s: float = field(
        default=5.0,
        metadata=setting(
            "parse_budget", DURATION, "CPU time one page may take to parse (in slices on the event loop)"
        ),
    )


@dataclass(frozen=True, slots=True)
class NvmlConfig:
    enabled: bool = field(default=True, metadata=setting("enabled", BOOL, "read GPUs through NVML"))
    fake_gpus: int = field(
        default=0,
        metadata=setting(
            "fake_gpus",
            INTEGER,
            "more than 0: use the fake NVML backend with this many GPUs (demo, tests)",
            minimum=0,
        ),
    )
    events: bool = field(default=True, metadata=setting("events", BOOL, "watch XID and health events"))


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    max_body_bytes: int = field(
        default=8 * 1024 * 1024, metadata=setting("max_body_bytes", SIZE, "largest request body; larger: 413")
    )
    client_header_timeout_s: float = field(
        default=10.0,
        metadata=setting(
            "client_header_timeout",
            DURATION,
            "slow-loris guard: a request's head and body must arrive in this",
        ),
    )
    client_keepalive_timeout_s: float = field(
        default=75.0,
        metadata=setting(
            "client_keepalive_timeout",
            DURATION,
            "an idle keep-alive client connection is closed after this; longer than client pools keep "
            "theirs (httpx/openai 5 s, aiohttp 15 s)",
        ),
    )
    upstream_connect_timeout_s: float = field(
        default=10.0, metadata=setting("upstream_connect_timeout", DURATION, "connecting to the engine")
    )
    upstream_read_timeout_s: float = field(
        default=600.0,
        metadata=setting(
            "upstream_read_timeout", DURATION, "longest silence from the engine within a response"
        ),
    )
    models: tuple[str, ...] = field(
        default=(),
        metadata=setting(
            "models",
            STRINGS,
            "accepted model_name label values beyond each replica's model_name",
            shown_default="[]",
        ),
    )
    inject_usage: bool = field(
        default=True,
        metadata=setting(
            "inject_usage", BOOL, "ask streams for their usage chunk (stream_options.include_usage)"
        ),
    )
    max_buffered_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=setting(
            "max_buffered_bytes",
            SIZE,
            "request bytes all of a proxy's clients may buffer at once (at least max_body_bytes); more: 503",
        ),
    )
    max_connections: int = field(
        default=1024,
        metadata=setting(
            "max_connections",
            INTEGER,
            "client connections per proxy; more are answered 503 and closed",
            minimum=1,
        ),
    )
    workers: int | None = field(
        default=None,
        metadata=setting(
            "workers",
            WORKER_COUNT,
            "relay worker processes sharing every proxy port (SO_REUSEPORT); `auto`: one per proxied "
            "replica, at most the CPUs the agent may use (affinity, cgroup CPU quota rounded up); "
            "0 or 1: the relay runs on the agent's own event loop",
            shown_default="auto",
        ),
    )


@dataclass(frozen=True, slots=True)
class OtlpConfig:
    listen: HostPort | None = field(
        default=None,
        metadata=setting(
            "listen", HOST_PORT, "where the OTLP/HTTP span receiver listens, e.g. 127.0.0.1:4318; unset: off"
        ),
    )
    replica: str | None = field(
        default=None,
        metadata=setting(
            "replica", NAME, "the replica the spans belong to (when one engine sends to this agent)"
        ),
    )
    max_body_bytes: int = field(
        default=16 * 1024 * 1024,
        metadata=setting("max_body_bytes", SIZE, "largest export as sent (compressed)"),
    )
    max_decompressed_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=setting(
            "max_decompressed_bytes",
            SIZE,
            "largest export inflated, checked while inflating (at least max_body_bytes)",
        ),
    )


@dataclass(frozen=True, slots=True)
class SglangFilesConfig:
    replica: str = field(metadata=setting("replica", NAME, "the replica the files belong to"))
    directory: str = field(metadata=setting("directory", PATH, "where SGLang writes its request files"))
    poll_s: float = field(default=1.0, metadata=setting("poll", DURATION, "look for new lines this often"))


@dataclass(frozen=True, slots=True)
class VllmPluginSocketConfig:
    """One replica's socket for kvwatch's vLLM stat-logger plugin (the engine's KVWATCH_VLLM_SOCKET)."""

    replica: str = field(metadata=setting("replica", NAME, "the replica whose plugin sends here"))
    path: str = field(metadata=setting("path", SOCKET_PATH, "the Unix datagram socket kvwatch binds"))


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    path: str | None = field(
        default=None,
        metadata=setting("path", PATH, "append one JSON line per finished request here; unset: off"),
    )
    max_bytes: int = field(
        default=64 * 1024 * 1024, metadata=setting("max_bytes", SIZE, "rotate the ledger at this size")
    )
    backups: int = field(default=4, metadata=setting("backups", INTEGER, "rotated files kept", minimum=0))


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    """``metrics``: what /metrics carries. Read at start (a reload keeps the running profile)."""

    profile: str = field(
        default=LEAN_PROFILE,
        metadata=setting(
            "profile",
            WORD,
            "`lean`: request histograms and request-path counters that no shipped alert reads "
            "per replica are per node (empty `replica`), NVLink counters per GPU (empty `link`), "
            "under 2,000 series on the reference 8-GPU node (docs/scale.md); `full`: every series per "
            "replica and link",
            choices=(LEAN_PROFILE, FULL_PROFILE),
        ),
    )


@dataclass(frozen=True, slots=True)
class KubernetesDiscoveryConfig:
    """``discovery.kubernetes``: engine pods on this node, listed and watched through the API server."""

    enabled: bool = field(
        default=False,
        metadata=setting(
            "enabled", BOOL, "find engine pods on this node (KVWATCH_NODE) through the API server"
        ),
    )
    api_url: str | None = field(
        default=None,
        metadata=setting(
            "api_url",
            BASE_URL,
            "API server base URL; unset: in-cluster (`https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`)",
        ),
    )
    token_file: str | None = field(
        default="/var/run/secrets/kubernetes.io/serviceaccount/token",
        metadata=setting("token_file", PATH, "the service account token"),
    )
    ca_file: str | None = field(
        default="/var/run/secrets/kubernetes.io/serviceaccount/ca.crt",
        metadata=setting(
            "ca_file", PATH, "the API server's CA bundle; it must exist when set (null: the system's CAs)"
        ),
    )
    recognise: bool = field(
        default=True,
        metadata=setting(
            "recognise", BOOL, "also take vLLM, SGLang, KServe and llm-d pods without kvwatch.io annotations"
        ),
    )
    watch_timeout_s: float = field(
        default=300.0,
        metadata=setting(
            "watch_timeout",
            DURATION,
            "the server ends each watch after this to twice this (timeoutSeconds, "
            "drawn at random as client-go's reflector draws it)",
        ),
    )
    backoff_max_s: float = field(
        default=30.0,
        metadata=setting("backoff_max", DURATION, "longest wait between retries of a failing list or watch"),
    )
    max_event_bytes: int = field(
        default=4 * 1024 * 1024,
        metadata=setting(
            "max_event_bytes", SIZE, "one watch event (one pod as JSON); etcd caps objects at 1.5 MB"
        ),
    )
    max_list_bytes: int = field(
        default=64 * 1024 * 1024, metadata=setting("max_list_bytes", SIZE, "one list response")
    )
    vllm_plugin_dir: str | None = field(
        default=None,
        metadata=setting(
            "vllm_plugin_dir",
            PLUGIN_DIR,
            "bind `DIR/<pod uid>/vllm.sock` for each discovered replica whose pod has that directory (the "
            "engine mounts `DIR` with `subPathExpr: $(POD_UID)`); unset: off",
        ),
    )


@dataclass(frozen=True, slots=True)
class PodResourcesConfig:
    """``discovery.pod_resources``: which containers hold which GPUs, from the kubelet (no hostPID)."""

    enabled: bool = field(
        default=False,
        metadata=setting("enabled", BOOL, "map GPUs to pods through the kubelet's PodResources API"),
    )
    socket: str = field(
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        metadata=setting("socket", PATH, "the kubelet's PodResources socket"),
    )
    resource_names: tuple[str, ...] = field(
        default=("nvidia.com/gpu",),
        metadata=setting(
            "resource_names", STRINGS, "extended resources that are GPUs", shown_default="[nvidia.com/gpu]"
        ),
    )
    interval_s: float = field(
        default=15.0, metadata=setting("interval", DURATION, "ask the kubelet this often")
    )
    timeout_s: float = field(default=5.0, metadata=setting("timeout", DURATION, "one call's timeout"))


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    kubernetes: KubernetesDiscoveryConfig = field(
        default_factory=KubernetesDiscoveryConfig,
        metadata=section(
            "kubernetes", KubernetesDiscoveryConfig, "engine pods on this node, from the API server"
        ),
    )
    pod_resources: PodResourcesConfig = field(
        default_factory=PodResourcesConfig,
        metadata=section(
            "pod_resources", PodResourcesConfig, "which containers hold which GPUs, from the kubelet"
        ),
    )


def _default_listen() -> HostPort:
    return parse_host_port(DEFAULT_LISTEN)


@dataclass(frozen=True, slots=True)
class Config:
    replicas: tuple[ReplicaConfig, ...] = field(
        default=(), metadata=entries("replicas", ReplicaConfig, "the engines on this node")
    )
    listen: HostPort = field(
        default_factory=_default_listen,
        metadata=setting(
            "listen",
            HOST_PORT,
            "where /metrics, the status page and /-/healthy listen; `:PORT` is all interfaces",
            shown_default=DEFAULT_LISTEN,
        ),
    )
    node: str = field(
        default_factory=socket.gethostname,
        metadata=setting("node", NAME, "the `node` label", shown_default="the host name"),
    )
    length_bands: LengthBands = field(
        default_factory=LengthBands,
        metadata=setting(
            "length_bands",
            EDGES,
            "output-length band edges in tokens",
            shown_default="[" + ", ".join(map(str, LengthBands().edges)) + "]",
        ),
    )
    intervals: IntervalsConfig = field(
        default_factory=IntervalsConfig,
        metadata=section("intervals", IntervalsConfig, "how often each source is read"),
    )
    scrape: ScrapeConfig = field(
        default_factory=ScrapeConfig,
        metadata=section("scrape", ScrapeConfig, "engine pages: timeouts and what one page may cost"),
    )
    nvml: NvmlConfig = field(default_factory=NvmlConfig, metadata=section("nvml", NvmlConfig, "GPUs"))
    proxy: ProxyConfig = field(
        default_factory=ProxyConfig,
        metadata=section("proxy", ProxyConfig, "the metering proxies (replicas[].proxy_listen)"),
    )
    otlp: OtlpConfig = field(
        default_factory=OtlpConfig, metadata=section("otlp", OtlpConfig, "the OTLP/HTTP span receiver")
    )
    sglang_request_files: tuple[SglangFilesConfig, ...] = field(
        default=(),
        metadata=entries("sglang_request_files", SglangFilesConfig, "SGLang request log files to follow"),
    )
    vllm_plugin_sockets: tuple[VllmPluginSocketConfig, ...] = field(
        default=(),
        metadata=entries(
            "vllm_plugin_sockets", VllmPluginSocketConfig, "one socket per replica for kvwatch's vLLM plugin"
        ),
    )
    ledger: LedgerConfig = field(
        default_factory=LedgerConfig, metadata=section("ledger", LedgerConfig, "the per-request ledger file")
    )
    log_level: str = field(
        default="info", metadata=setting("log_level", WORD, "the agent's log level", choices=LOG_LEVELS)
    )
    discovery: DiscoveryConfig = field(
        default_factory=DiscoveryConfig,
        metadata=section("discovery", DiscoveryConfig, "Kubernetes discovery"),
    )
    metrics: MetricsConfig = field(
        default_factory=MetricsConfig, metadata=section("metrics", MetricsConfig, "what /metrics carries")
    )

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
