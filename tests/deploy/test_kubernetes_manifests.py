"""Every Kubernetes manifest in deploy/kubernetes, rendered per overlay and checked offline.

Core kinds go through the real ``kubernetes-validate --strict`` (unknown fields fail); the
prometheus-operator kinds through a schema transcribed from their CRDs (data/); the pod specs through
least-privilege rules; and the agent configs inside them through kvwatch's own config loader, so a
manifest can never ship a config the agent would refuse.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from kvwatch.config import parse_host_port
from kvwatch.discovery.kube_api import POD_VERBS
from kvwatch.mixin import k8s
from tests.deploy.manifests import (
    KUBE,
    ROOT,
    WORKLOADS,
    agent_config,
    build,
    container_env,
    containers,
    kvwatch_container,
    kvwatch_pod,
    one,
    pod_specs,
)

OVERLAYS = ("node-agent", "pid-mapping", "sidecar-example", "discovery")
#: overlays whose namespace admits privileged pods, and the one thing each needs it for
PRIVILEGED_NAMESPACE = {"pid-mapping": "hostPID", "discovery": "the kubelet's pod-resources socket"}
POD_RESOURCES = "/var/lib/kubelet/pod-resources"
VLLM_PLUGIN_DIR = "/run/kvwatch/vllm"  # the vLLM plugin's sockets, one directory per engine pod
KUBE_VERSIONS = ("1.29.0", "1.37.0")  # 1.29: first release with native sidecars on by default
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
CRD_SCHEMA = yaml.safe_load(
    (Path(__file__).parent / "data" / "prometheus-operator-v1-subset.yaml").read_text(encoding="utf-8")
)
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding", "RuntimeClass"}


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, build(KUBE / "overlays" / request.param)


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


def test_every_overlay_renders_the_objects_its_mode_needs(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    kinds = {o["kind"] for o in objects}
    if name == "sidecar-example":
        assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodMonitor"} <= kinds
        assert "DaemonSet" not in kinds and "ServiceMonitor" not in kinds  # one scrape path per pod
    else:
        assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"} <= kinds
        assert "PodMonitor" not in kinds
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] not in CLUSTER_SCOPED}
    assert namespaces == {one(objects, "Namespace")["metadata"]["name"]}
    assert {o["kind"] for o in objects} & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"} == (
        {"ClusterRole", "ClusterRoleBinding"} if name == "discovery" else set()
    )


# --------------------------------------------------------------------------------------------
# schemas
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_core_objects_pass_kubernetes_validate_strict(
    overlay: tuple[str, list[dict[str, Any]]], version: str, tmp_path: Path
) -> None:
    name, objects = overlay
    core = [o for o in objects if o["kind"] not in CRD_KINDS]
    rendered = tmp_path / f"{name}.yaml"
    rendered.write_text(yaml.safe_dump_all(core, sort_keys=False))
    command = [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, str(rendered)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    # A kind without a schema is only a WARN for kubernetes-validate: demand a pass for each object.
    assert out.stdout.count(" passed for resource ") == len(core), out.stdout


def _crd_errors(obj: dict[str, Any]) -> list[str]:
    schema = {"$defs": CRD_SCHEMA["$defs"], **CRD_SCHEMA["kinds"][obj["kind"]]}
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_prometheus_operator_objects_use_only_crd_fields(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    _, objects = overlay
    crs = [o for o in objects if o["kind"] in CRD_KINDS]
    assert crs
    for obj in crs:
        assert _crd_errors(obj) == [], obj["metadata"]["name"]


def test_crd_schema_subset_rejects_a_misspelt_field() -> None:
    monitor = one(build(KUBE / "base"), "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["honorLabel"] = False
    assert any("honorLabel" in e for e in _crd_errors(monitor))
    monitor["spec"]["endpoints"][0].pop("honorLabel")
    monitor["spec"]["endpoints"][0]["interval"] = "15 seconds"
    assert any("interval" in e for e in _crd_errors(monitor))


def test_rule_groups_have_unique_names_within_each_prometheusrule(overlay) -> None:
    _, objects = overlay
    for rule in (o for o in objects if o["kind"] == "PrometheusRule"):
        names = [g["name"] for g in rule["spec"]["groups"]]
        assert len(names) == len(set(names))  # the CRD's list-map key: duplicates are rejected


# --------------------------------------------------------------------------------------------
# least privilege
# --------------------------------------------------------------------------------------------


def test_every_container_runs_without_privileges(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    discovery = name == "discovery"  # its exceptions: a token, the pod-resources socket, UID 0
    for pod in pod_specs(objects):
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is discovery
        assert not pod.get("hostNetwork") and not pod.get("hostIPC")
        host_paths = [v["hostPath"] for v in pod.get("volumes", []) if "hostPath" in v]
        assert host_paths == (
            [
                {"path": POD_RESOURCES, "type": "Directory"},
                {"path": VLLM_PLUGIN_DIR, "type": "DirectoryOrCreate"},
            ]
            if discovery
            else []
        )
        for c in containers(pod):
            sc = c["securityContext"]
            run_as_non_root = sc.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot"))
            assert run_as_non_root is not discovery, c["name"]
            uid = sc.get("runAsUser", pod["securityContext"].get("runAsUser", 1))
            assert (uid == 0) is discovery, c["name"]
            for mount in c.get("volumeMounts", []):
                if mount["mountPath"] == POD_RESOURCES:
                    assert mount["readOnly"] is True
            assert sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["allowPrivilegeEscalation"] is False, c["name"]
            assert sc.get("privileged", False) is False, c["name"]
            assert sc["capabilities"] == {"drop": ["ALL"]}, c["name"]
            assert "hostPort" not in str(c.get("ports", [])), c["name"]


def test_host_pid_only_in_the_pid_mapping_overlay(overlay: tuple[str, list[dict[str, Any]]]) -> None:
    name, objects = overlay
    host_pid = [bool(p.get("hostPID")) for p in pod_specs(objects)]
    assert host_pid == [name == "pid-mapping"] * len(host_pid)
    # hostPID and hostPath are outside Pod Security "baseline": the overlay must say so on its namespace.
    enforce = one(objects, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert enforce == ("privileged" if name in PRIVILEGED_NAMESPACE else "restricted")


def test_discovery_may_read_pods_and_nothing_else() -> None:
    objects = build(KUBE / "overlays" / "discovery")
    role = one(objects, "ClusterRole")
    # exactly the verbs the agent sends (no get: it never reads one pod by name)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": list(POD_VERBS)}]
    binding = one(objects, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    daemonset = one(objects, "DaemonSet")
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": daemonset["spec"]["template"]["spec"]["serviceAccountName"],
            "namespace": daemonset["metadata"]["namespace"],
        }
    ]


def test_discovery_needs_no_per_node_configuration() -> None:
    objects = build(KUBE / "overlays" / "discovery")
    cfg = agent_config(objects)
    assert cfg.replicas == ()  # found, not listed
    assert cfg.discovery.kubernetes.enabled and cfg.discovery.kubernetes.api_url is None  # in-cluster
    assert cfg.discovery.pod_resources.enabled
    assert cfg.discovery.pod_resources.socket.startswith(POD_RESOURCES + "/")
    container = kvwatch_container(kvwatch_pod(objects))
    assert "KVWATCH_REPLICAS" not in container_env(container)
    assert container_env(container)["KVWATCH_NODE"] == "gpu-node-1"  # the field selector's node


def test_node_agent_observes_gpus_without_allocating_any() -> None:
    pod = kvwatch_pod(build(KUBE / "base"))
    container = kvwatch_container(pod)
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in container["resources"][section]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_pods_running_kvwatch_get_no_service_link_variables(overlay) -> None:
    """The kubelet injects <SERVICE>_PORT=tcp://... for every Service; for a Service named kvwatch
    those would be read as KVWATCH_* config overrides and refused."""
    _, objects = overlay
    assert kvwatch_pod(objects)["enableServiceLinks"] is False


def test_kvwatch_resources_follow_the_measured_sizing() -> None:
    """Requests and a memory limit from docs/performance.md ("Sizing"), no CPU limit (throttling the
    proxy would add latency to every stream)."""
    sizing = (ROOT / "docs" / "performance.md").read_text()
    assert "## Sizing" in sizing
    limits = {  # the DaemonSet's holds 8 relay worker processes (proxy.workers: auto, 8 proxied replicas)
        KUBE / "base" / "daemonset.yaml": "512Mi",
        KUBE / "overlays" / "sidecar-example" / "deployment.yaml": "256Mi",  # one replica: no workers
    }
    for path, limit in limits.items():
        text = path.read_text()
        assert 'sized from docs/performance.md ("Sizing")' in text, path
        for doc in yaml.safe_load_all(text):
            for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                if c["name"] != "kvwatch":
                    continue
                res = c["resources"]
                assert res["requests"]["memory"] == "96Mi" and res["limits"]["memory"] == limit
                assert "cpu" in res["requests"] and "cpu" not in res.get("limits", {})


# --------------------------------------------------------------------------------------------
# the agent inside: config, ports, probes
# --------------------------------------------------------------------------------------------


def test_agent_config_in_each_overlay_is_accepted_by_kvwatch(overlay) -> None:
    name, objects = overlay
    cfg = agent_config(objects)
    assert cfg.node == "gpu-node-1"
    assert bool(cfg.replicas) is not cfg.discovery.kubernetes.enabled
    assert cfg.discovery.kubernetes.enabled is (name == "discovery")


def test_node_agent_reaches_engines_on_the_node_ip() -> None:
    cfg = agent_config(build(KUBE / "base"))
    assert [r.metrics_url for r in cfg.replicas] == ["http://10.0.0.7:8000/metrics"]
    assert cfg.nvml.enabled


def _port(container: dict[str, Any], name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def test_probes_hit_the_agents_health_routes_on_its_listen_port(overlay) -> None:
    from prometheus_client import CollectorRegistry

    from kvwatch.export.server import metrics_app

    _, objects = overlay
    container = kvwatch_container(kvwatch_pod(objects))
    routes = {r.resource.canonical for r in metrics_app(CollectorRegistry(), lambda: True).router.routes()}
    assert container["livenessProbe"]["httpGet"]["path"] == "/-/healthy"
    assert container["readinessProbe"]["httpGet"]["path"] == "/-/ready"
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] in routes
        assert container[probe]["httpGet"]["port"] == "metrics"
    assert _port(container, "metrics") == agent_config(objects).listen.port == 9477


def test_scrape_objects_select_the_agent_and_name_its_port(overlay) -> None:
    name, objects = overlay
    pod_object = next(
        o for o in objects if o["kind"] in WORKLOADS and o["spec"]["template"]["spec"] is kvwatch_pod(objects)
    )
    pod_labels = pod_object["spec"]["template"]["metadata"]["labels"]
    if name == "sidecar-example":
        monitor = one(objects, "PodMonitor")
        assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        endpoints = monitor["spec"]["podMetricsEndpoints"]
    else:
        service = one(objects, "Service")
        monitor = one(objects, "ServiceMonitor")
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["publishNotReadyAddresses"] is True  # a not-ready agent is still scraped
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert service["spec"]["ports"] == [
            {"name": "metrics", "port": 9477, "targetPort": "metrics", "protocol": "TCP"}
        ]
        endpoints = monitor["spec"]["endpoints"]
    [endpoint] = endpoints
    assert endpoint["port"] == "metrics" and endpoint["interval"] == "15s"
    assert endpoint["honorLabels"] is False
    assert {
        "sourceLabels": ["__meta_kubernetes_pod_node_name"],
        "targetLabel": "node",
        "action": "replace",
    } in endpoint["relabelings"]


def test_sidecar_clients_reach_vllm_only_through_the_proxy() -> None:
    objects = build(KUBE / "overlays" / "sidecar-example")
    pod = kvwatch_pod(objects)
    kvwatch = kvwatch_container(pod)
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    cfg = agent_config(objects)
    [replica] = cfg.replicas
    service = one(objects, "Service")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["proxy"]
    assert _port(kvwatch, "proxy") == replica.proxy_listen.port
    assert "--host=127.0.0.1" in vllm["args"]
    assert replica.api_url == "http://127.0.0.1:8000" and "--port=8000" in vllm["args"]
    assert kvwatch["restartPolicy"] == "Always"  # native sidecar: outlives vLLM on shutdown
    assert "nvidia.com/gpu" not in kvwatch["resources"]["limits"] and not cfg.nvml.enabled


def test_the_node_agents_discovery_leaves_the_sidecar_pod_alone() -> None:
    # discovery recognised its vLLM, scraped the pod IP where vLLM does not listen (loopback only)
    # and counted the engine beside the sidecar: KVWatchEngineTargetDown for every sidecar pod
    from kvwatch.discovery.pods import judge_pod

    deployment = one(build(KUBE / "overlays" / "sidecar-example"), "Deployment")
    pod = {
        "metadata": {
            **deployment["spec"]["template"]["metadata"],
            "name": "qwen3-8b-0",
            "namespace": "llm-serving",
        },
        "spec": deployment["spec"]["template"]["spec"],
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    assert judge_pod(pod).engine is None
    without = {**pod, "metadata": {**pod["metadata"], "annotations": {}}}
    assert judge_pod(without).engine is not None  # what the annotation keeps out


def test_the_sidecar_example_leaves_rules_and_dashboards_where_grafana_looks() -> None:
    kinds = {o["kind"] for o in build(KUBE / "overlays" / "sidecar-example")}
    assert "PrometheusRule" not in kinds  # moved into llm-serving, away from the kvwatch namespace
    monitoring = build(KUBE / "monitoring")
    assert {o["metadata"]["namespace"] for o in monitoring} == {"kvwatch"}


def test_sidecar_receives_vllm_spans_over_otlp_http_on_loopback() -> None:
    objects = build(KUBE / "overlays" / "sidecar-example")
    pod = kvwatch_pod(objects)
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    cfg = agent_config(objects)
    endpoint = next(a.split("=", 1)[1] for a in vllm["args"] if a.startswith("--otlp-traces-endpoint="))
    assert endpoint == f"http://{cfg.otlp.listen}/v1/traces"
    assert cfg.otlp.listen == parse_host_port("127.0.0.1:4318")
    assert cfg.otlp.replica == cfg.replicas[0].name
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"  # vLLM's default is gRPC


# --------------------------------------------------------------------------------------------
# generated monitoring objects
# --------------------------------------------------------------------------------------------


def test_generated_monitoring_manifests_are_up_to_date() -> None:
    generated = k8s.generate(ROOT / "alerts", ROOT / "dashboards", root=ROOT)
    for name, text in generated.items():
        on_disk = (KUBE / "monitoring" / name).read_text(encoding="utf-8")
        assert on_disk == text, f"deploy/kubernetes/monitoring/{name} is stale: run `kvwatch manifests`"


def test_monitoring_kustomization_lists_every_generated_file() -> None:
    kustomization = yaml.safe_load((KUBE / "monitoring" / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {k8s.RULES_FILE, k8s.DASHBOARDS_FILE}


def test_every_scrape_path_gives_the_job_label_the_alerts_select(overlay) -> None:
    from kvwatch.mixin.alerts import DEFAULT_JOB

    name, objects = overlay
    if name == "sidecar-example":
        [endpoint] = one(objects, "PodMonitor")["spec"]["podMetricsEndpoints"]
        job = {"targetLabel": "job", "replacement": DEFAULT_JOB, "action": "replace"}
        assert job in endpoint["relabelings"]
    else:
        monitor = one(objects, "ServiceMonitor")
        assert "jobLabel" not in monitor["spec"]  # job = the Service's name
        assert one(objects, "Service")["metadata"]["name"] == DEFAULT_JOB
