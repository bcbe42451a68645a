"""The ServiceMonitor's metric relabelings through a real Prometheus: GPU series keep the pod that holds
the GPU although namespace, pod and container are also target labels (the Operator attaches kvwatch's
own), and a GPU nobody holds is not made kvwatch's."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.e2e.stack import Prometheus, wait_until

pytestmark = pytest.mark.prometheus

MONITOR = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "base" / "servicemonitor.yaml"
PAGE = b"""# TYPE kvwatch_gpu_memory_used_bytes gauge
kvwatch_gpu_memory_used_bytes{container="vllm",gpu="0",namespace="llm",pod="qwen-0",uuid="GPU-a"} 1.0
kvwatch_gpu_memory_used_bytes{container="",gpu="1",namespace="",pod="",uuid="GPU-b"} 2.0
# TYPE kvwatch_target_up gauge
kvwatch_target_up{backend="vllm",replica="llm/qwen-0"} 1.0
"""
#: what the Prometheus Operator attaches to a ServiceMonitor target
TARGET = {"namespace": "kvwatch", "pod": "kvwatch-x7k2p", "container": "kvwatch", "service": "kvwatch"}


def _snake(name: str) -> str:
    return re.sub(r"([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def _relabel_configs(monitor: dict) -> list[dict]:
    """The CRD's camelCase relabelings as Prometheus' relabel_configs (what the Operator generates)."""
    endpoint = monitor["spec"]["endpoints"][0]
    return [{_snake(k): v for k, v in rule.items()} for rule in endpoint["metricRelabelings"]]


class _Page(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(PAGE)

    def log_message(self, *args) -> None:
        pass


def test_gpu_series_name_their_holder_and_other_series_keep_the_target(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monitor = yaml.safe_load(MONITOR.read_text())
    scrape = {
        "job_name": "kvwatch",
        "honor_labels": monitor["spec"]["endpoints"][0]["honorLabels"],
        "static_configs": [{"targets": [f"127.0.0.1:{server.server_address[1]}"], "labels": TARGET}],
        "metric_relabel_configs": _relabel_configs(monitor),
    }
    prometheus = Prometheus(tmp_path, [], rule_files=(), extra_scrape_configs=[scrape]).start()
    try:
        gpus = wait_until(
            lambda: (
                len(prometheus.query("kvwatch_gpu_memory_used_bytes")) == 2
                and prometheus.query("kvwatch_gpu_memory_used_bytes")
            ),
            30,
            "GPU series scraped",
        )
        by_uuid = {s["metric"]["uuid"]: s["metric"] for s in gpus}
        held, free = by_uuid["GPU-a"], by_uuid["GPU-b"]
        assert (held["namespace"], held["pod"], held["container"]) == ("llm", "qwen-0", "vllm")
        assert not {"namespace", "pod", "container"} & set(free)
        assert not any(k.startswith("exported_") for s in gpus for k in s["metric"])
        up = prometheus.query("kvwatch_target_up")[0]["metric"]
        assert (up["namespace"], up["pod"], up["container"]) == ("kvwatch", "kvwatch-x7k2p", "kvwatch")
    finally:
        prometheus.stop()
        server.shutdown()
