"""The objects deploy/kubernetes renders to, and the kvwatch pod, container and agent config in them.

The manifest checks and the discovery tests read the same overlays, so they share one rendering (and
one ``kubectl kustomize`` per directory) and one reading of where the agent and its config sit.
"""

from __future__ import annotations

import functools
import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kvwatch.config import apply_env_overrides, config_from_mapping
from tests.local import require_tool

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
WORKLOADS = {"DaemonSet", "Deployment"}


@functools.cache
def _rendered(directory: Path) -> str:
    out = subprocess.run(
        [require_tool("kubectl"), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k`` would send: ``kubectl kustomize`` (the kustomize built into
    kubectl) renders them; each call gets its own copies."""
    return [doc for doc in yaml.safe_load_all(_rendered(directory)) if doc]


def one(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] in WORKLOADS]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def kvwatch_container(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in containers(pod) if c["name"] == "kvwatch")


def kvwatch_pod(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return next(p for p in pod_specs(objects) if any(c["name"] == "kvwatch" for c in containers(p)))


FAKE_FIELDS = {"status.hostIP": "10.0.0.7", "spec.nodeName": "gpu-node-1"}


def container_env(container: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the kubelet builds it, $(VAR) references expanded."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "valueFrom" in item:
            env[item["name"]] = FAKE_FIELDS[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = re.sub(
                r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), item["value"]
            )
    return env


def agent_config(objects: list[dict[str, Any]]):
    pod = kvwatch_pod(objects)
    container = kvwatch_container(pod)
    args = container["args"]
    assert args[:2] == ["run", "--config"]
    mount = next(m for m in container["volumeMounts"] if args[2].startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = one(objects, "ConfigMap", volume["configMap"]["name"])
    data = yaml.safe_load(configmap["data"][Path(args[2]).name])
    env = container_env(container)
    return config_from_mapping(apply_env_overrides(data, env), configmap["metadata"]["name"])
