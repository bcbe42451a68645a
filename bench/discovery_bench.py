"""Kubernetes discovery cost: reading the pod watch stream and judging pods, against plain json.loads.

What a watch event costs the agent's event loop, on a realistic vLLM pod object (the API's JSON of a
pod with probes, env, volumes, status; ~6 KiB) and on the largest event the budget admits:

- ``json.loads`` of the same lines (the peer: the least any JSON watch client must do),
- ``split_lines`` + ``decode_event`` (kvwatch: bounded line splitting, event checks) on the stream
  cut into 16 KiB chunks as a socket delivers it (ratio = kvwatch / peer: 1.0 is no overhead),
- ``PodDiscovery.on_pods`` for a node at the kubelet's default max-pods (110) after one event: the
  changed pod judged, the others' verdicts reused by resourceVersion; and the first list (all judged).

  .venv/bin/python -m bench.discovery_bench [--quick]
"""

from __future__ import annotations

import copy
import json
import statistics

from bench._harness import median_seconds, parser
from kvwatch.config import Config
from kvwatch.discovery.kube_api import decode_event, split_lines
from tests.discovery.fake_apiserver import make_pod, pod_conditions, vllm_container

CHUNK = 16 * 1024


def realistic_pod(i: int) -> dict:
    container = vllm_container(8000)
    container["env"] = [{"name": f"VAR_{k}", "value": "x" * 40} for k in range(30)]
    container["resources"] = {
        "limits": {"nvidia.com/gpu": "1", "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": "1", "cpu": "8"},
    }
    container["readinessProbe"] = {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5}
    container["volumeMounts"] = [{"name": f"v{k}", "mountPath": f"/mnt/v{k}"} for k in range(6)]
    pod = make_pod(
        f"qwen-{i}",
        labels={"app": "qwen", "pod-template-hash": "7d9f8c6b5"},
        annotations={"kubectl.kubernetes.io/restartedAt": "2026-12-01T18:00:00Z"},
        containers=[container],
    )
    pod["spec"]["volumes"] = [{"name": f"v{k}", "emptyDir": {}} for k in range(6)]
    pod["metadata"]["managedFields"] = [
        {
            "manager": "kubelet",
            "operation": "Update",
            "fieldsV1": {"f:status": {f"f:c{k}": {} for k in range(40)}},
        }
    ]
    pod["status"].update(phase="Running", podIP=f"10.1.0.{i % 250}", conditions=pod_conditions(True))
    return pod


def main() -> None:
    args = parser(__doc__).parse_args()
    events, runs, rounds = (110, 1, 10) if args.quick else (2000, 7, 200)  # >= 110 pods: one node's max
    pods = [realistic_pod(i) for i in range(events)]
    lines = [json.dumps({"type": "MODIFIED", "object": p}).encode() + b"\n" for p in pods]
    stream = b"".join(lines)
    chunks = [stream[i : i + CHUNK] for i in range(0, len(stream), CHUNK)]
    size = statistics.mean(len(line) for line in lines)

    def peer() -> None:
        for line in lines:
            json.loads(line)

    def kvwatch() -> None:
        buffer = bytearray()
        for chunk in chunks:
            for line in split_lines(buffer, chunk, 4 * 1024 * 1024):
                decode_event(line)

    t_peer, t_kv = median_seconds(peer, runs), median_seconds(kvwatch, runs)
    print(f"watch events: {events} x {size / 1024:.1f} KiB pod objects, {CHUNK // 1024} KiB chunks")
    print(f"  json.loads (peer)          {t_peer / events * 1e6:8.1f} us/event")
    print(f"  split_lines + decode_event {t_kv / events * 1e6:8.1f} us/event   ratio {t_kv / t_peer:.2f}")

    big = make_pod("huge", annotations={"blob": "x" * (4 * 1024 * 1024 - 2048)})
    big_line = json.dumps({"type": "MODIFIED", "object": big}).encode()
    t_big = median_seconds(lambda: decode_event(big_line), runs)
    print(f"  largest admitted event ({len(big_line) / 2**20:.1f} MiB): {t_big * 1e3:.1f} ms")

    from kvwatch.agent.discovery import PodDiscovery
    from kvwatch.config import DiscoveryConfig, KubernetesDiscoveryConfig
    from kvwatch.model import LengthBands
    from kvwatch.state import NodeState

    config = Config(
        node="node-a", discovery=DiscoveryConfig(KubernetesDiscoveryConfig(enabled=True, api_url="http://x"))
    )
    discovery = PodDiscovery(config, NodeState("node-a", LengthBands()), lambda replicas: None)
    node_pods = {p["metadata"]["uid"]: p for p in copy.deepcopy(pods[:110])}
    for i, pod in enumerate(node_pods.values()):
        pod["metadata"]["resourceVersion"] = str(1000 + i)
    t_first = median_seconds(lambda: (discovery._verdicts.clear(), discovery.on_pods(node_pods)), runs)
    changed = next(iter(node_pods.values()))

    def one_event() -> None:
        for n in range(rounds):
            changed["metadata"]["resourceVersion"] = str(5000 + n)
            discovery.on_pods(node_pods)

    t_event = median_seconds(one_event, runs)
    print(
        f"  on_pods, 110 pods (max-pods): first list {t_first * 1e3:.2f} ms, "
        f"then {t_event / rounds * 1e3:.3f} ms per event"
    )


if __name__ == "__main__":
    main()
