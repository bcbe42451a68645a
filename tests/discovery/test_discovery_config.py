"""The discovery section of the config: defaults, key paths in errors, environment overrides."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvwatch.config import ConfigError, apply_env_overrides, config_from_mapping


def test_discovery_is_off_unless_asked_and_defaults_to_the_in_cluster_api():
    cfg = config_from_mapping({})
    assert not cfg.discovery.kubernetes.enabled and not cfg.discovery.pod_resources.enabled
    on = {"enabled": True}
    cfg = config_from_mapping({"discovery": {"kubernetes": on, "pod_resources": on}})
    assert cfg.discovery.kubernetes.api_url is None
    assert cfg.discovery.kubernetes.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    assert cfg.discovery.pod_resources.socket == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert cfg.discovery.pod_resources.resource_names == ("nvidia.com/gpu",)


def test_ca_file_null_is_the_systems_cas_as_the_docs_and_the_error_say():
    # an explicit null read as "the default", the service account's CA file: the advice kvwatch
    # gives when that file is missing (set ca_file: null) did nothing
    kube = {"enabled": True, "api_url": "https://10.0.0.1:6443", "ca_file": None}
    config = config_from_mapping({"node": "n", "discovery": {"kubernetes": kube}})
    assert config.discovery.kubernetes.ca_file is None
    assert config.discovery.kubernetes.token_file == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    unset = config_from_mapping({"node": "n", "discovery": {"kubernetes": {"enabled": True}}})
    assert unset.discovery.kubernetes.ca_file == "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"


def test_bad_discovery_keys_are_named_with_their_path():
    with pytest.raises(ConfigError) as err:
        config_from_mapping(
            {
                "discovery": {
                    "kubernetes": {
                        "enabled": "sometimes",
                        "watch_timeout": "-1s",
                        "api_url": "kubernetes.default",
                    },
                    "pod_resource": {},
                }
            }
        )
    paths = [path for path, _ in err.value.problems]
    assert paths == [
        "discovery.pod_resource",
        "discovery.kubernetes.enabled",
        "discovery.kubernetes.api_url",
        "discovery.kubernetes.watch_timeout",
    ]


def test_the_daemonset_can_switch_discovery_on_from_the_environment():
    data = apply_env_overrides(
        {},
        {
            "KVWATCH_DISCOVERY__KUBERNETES__ENABLED": "true",
            "KVWATCH_DISCOVERY__POD_RESOURCES__RESOURCE_NAMES": "[nvidia.com/gpu, nvidia.com/gpu.shared]",
        },
    )
    cfg = config_from_mapping(data)
    assert cfg.discovery.kubernetes.enabled
    assert cfg.discovery.pod_resources.resource_names == ("nvidia.com/gpu", "nvidia.com/gpu.shared")


def test_check_config_says_what_will_be_discovered(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text("node: gpu-7\ndiscovery: {kubernetes: {enabled: true}, pod_resources: {enabled: true}}\n")
    out = subprocess.run(
        [sys.executable, "-m", "kvwatch.cli", "check-config", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "discovery: pods on node gpu-7 through the in-cluster API, GPU owners from "
        "/var/lib/kubelet/pod-resources/kubelet.sock" in out
    )
