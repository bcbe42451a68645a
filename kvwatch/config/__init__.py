"""Agent configuration: the schema (schema.py), the generic validator (validate.py), the loader (loader.py).

Every error names the key path (``replicas[1].metrics_url``), or the ``KVWATCH_*`` variable that set
it, and what was expected; all errors are reported at once so a user fixes a config in one pass
(``kvwatch check-config``).
"""

from kvwatch.config.loader import (
    MAX_YAML_NODES,
    BoundedSafeLoader,
    apply_env_overrides,
    config_from_mapping,
    env_key_path,
    env_variable,
    load_config,
    read_env_overrides,
    read_yaml_file,
    safe_load,
)
from kvwatch.config.schema import (
    DEFAULT_LISTEN,
    ENV_PREFIX,
    Config,
    DiscoveryConfig,
    IntervalsConfig,
    KubernetesDiscoveryConfig,
    LedgerConfig,
    MetricsConfig,
    NvmlConfig,
    OtlpConfig,
    PodResourcesConfig,
    ProxyConfig,
    ReplicaConfig,
    ScrapeConfig,
    SglangFilesConfig,
    VllmPluginSocketConfig,
)
from kvwatch.config.validate import (
    QUOTE_LIMIT,
    ConfigError,
    HostPort,
    KeyPathReader,
    brief,
    parse_duration,
    parse_host_port,
    parse_size,
    quoted,
    short_name,
)

__all__ = [
    "DEFAULT_LISTEN", "ENV_PREFIX", "MAX_YAML_NODES", "QUOTE_LIMIT", "BoundedSafeLoader", "Config",
    "ConfigError", "DiscoveryConfig", "HostPort", "IntervalsConfig", "KeyPathReader",
    "KubernetesDiscoveryConfig", "LedgerConfig", "MetricsConfig", "NvmlConfig", "OtlpConfig",
    "PodResourcesConfig",
    "ProxyConfig", "ReplicaConfig", "ScrapeConfig", "SglangFilesConfig", "VllmPluginSocketConfig",
    "apply_env_overrides", "brief", "config_from_mapping", "env_key_path", "env_variable", "load_config",
    "parse_duration", "parse_host_port", "parse_size", "quoted", "read_env_overrides", "read_yaml_file",
    "safe_load", "short_name",
]
