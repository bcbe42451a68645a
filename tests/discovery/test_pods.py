"""Which pods are engines and where their metrics are (kvwatch.discovery.pods), on pod objects as the API
returns them."""

from __future__ import annotations

import copy

import pytest

from kvwatch.discovery.pods import PodVerdict, is_ready, judge_pod
from tests.discovery.fake_apiserver import make_pod, pod_conditions, vllm_container


def _ready(pod: dict, ip: str = "10.1.2.3") -> dict:
    pod = copy.deepcopy(pod)
    pod["status"].update(phase="Running", podIP=ip, conditions=pod_conditions(True))
    return pod


def test_a_vllm_container_is_recognised_by_image_and_port_argument():
    verdict = judge_pod(_ready(make_pod("qwen-0", containers=[vllm_container(8100)])))
    assert verdict.engine is not None
    assert verdict.engine.replica == "llm/qwen-0"
    assert verdict.engine.metrics_url == "http://10.1.2.3:8100/metrics"
    assert (verdict.engine.backend, verdict.engine.recognised_by) == ("vllm", "vllm")


def test_llm_d_decode_pod_scrapes_vllm_behind_its_routing_sidecar():
    # llm-d's modelservice: image ghcr.io/llm-d/llm-d, command vllm serve, --port 8200; sidecar on 8000
    vllm = {
        "name": "vllm",
        "image": "ghcr.io/llm-d/llm-d:v0.2.0",
        "command": ["vllm", "serve"],
        "args": ["Qwen/Qwen3-0.6B", "--port", "8200"],
    }
    pod = make_pod(
        "decode-1", labels={"llm-d.ai/inferenceServing": "true", "llm-d.ai/role": "decode"}, containers=[vllm]
    )
    engine = judge_pod(_ready(pod)).engine
    assert engine is not None and engine.metrics_url == "http://10.1.2.3:8200/metrics"
    assert engine.recognised_by == "llm-d" and engine.backend == "vllm"


def test_kserve_predictor_uses_kserves_prometheus_annotations():
    container = {
        "name": "kserve-container",
        "image": "kserve/huggingfaceserver:v0.15.0",
        "args": ["--model_name=qwen", "--http_port=8080"],
    }
    pod = make_pod(
        "qwen-predictor-abc",
        labels={"serving.kserve.io/inferenceservice": "qwen"},
        annotations={"prometheus.kserve.io/port": "8080", "prometheus.kserve.io/path": "/metrics"},
        containers=[container],
    )
    engine = judge_pod(_ready(pod)).engine
    assert engine is not None and engine.recognised_by == "kserve"
    assert engine.metrics_url == "http://10.1.2.3:8080/metrics" and engine.backend == "auto"


def test_kserve_pods_that_serve_no_llm_are_left_alone():
    pod = make_pod(
        "iris",
        labels={"serving.kserve.io/inferenceservice": "iris"},
        containers=[{"name": "kserve-container", "image": "kserve/sklearnserver:v0.15.0"}],
    )
    verdict = judge_pod(_ready(pod))
    assert verdict.engine is None and not verdict.problems


def test_annotations_select_any_pod_and_a_named_port_resolves():
    pod = make_pod(
        "tgi",
        annotations={
            "kvwatch.io/scrape": "true",
            "kvwatch.io/port": "prom",
            "kvwatch.io/backend": "tgi",
            "kvwatch.io/model": "llama",
        },
        containers=[
            {
                "name": "tgi",
                "image": "ghcr.io/huggingface/text-generation-inference",
                "ports": [{"name": "prom", "containerPort": 9000}],
            }
        ],
    )
    engine = judge_pod(_ready(pod, "fd00::5")).engine
    assert engine is not None and engine.metrics_url == "http://[fd00::5]:9000/metrics"
    assert (engine.backend, engine.model_name) == ("tgi", "llama")


def test_scrape_false_excludes_a_recognised_engine():
    pod = make_pod("off", annotations={"kvwatch.io/scrape": "false"}, containers=[vllm_container()])
    assert judge_pod(_ready(pod)).engine is None


@pytest.mark.parametrize(
    ("annotations", "key", "fragment"),
    [
        ({"kvwatch.io/port": "99999"}, "kvwatch.io/port", "out of range"),
        ({"kvwatch.io/port": "no_such"}, "kvwatch.io/port", "port number or a container port name"),
        ({"kvwatch.io/port": "nope"}, "kvwatch.io/port", "no container port named 'nope'"),
        ({"kvwatch.io/backend": "tensorflow"}, "kvwatch.io/backend", "unknown backend"),
        ({"kvwatch.io/scrape": "maybe"}, "kvwatch.io/scrape", "expected true or false"),
        ({"kvwatch.io/path": "metrics"}, "kvwatch.io/path", "absolute URL path"),
    ],
)
def test_a_malformed_annotation_is_named_with_the_reason(annotations, key, fragment):
    pod = make_pod("bad", annotations=annotations, containers=[vllm_container()])
    verdict = judge_pod(_ready(pod))
    assert verdict.engine is None
    assert [k for k, _ in verdict.problems] == [key]
    assert fragment in verdict.problems[0][1]


def test_a_malformed_scrape_annotation_is_named_on_a_pod_kvwatch_does_not_recognise():
    # "maybe" is neither a yes nor a no: the pod is left alone, and the reason was dropped with it
    llama = {"name": "llama", "image": "ghcr.io/ggml-org/llama.cpp:server"}
    pod = make_pod("odd", annotations={"kvwatch.io/scrape": "maybe"}, containers=[llama])
    verdict = judge_pod(_ready(pod))
    assert verdict.engine is None
    assert [k for k, _ in verdict.problems] == ["kvwatch.io/scrape"]


@pytest.mark.parametrize(
    "change",
    [
        lambda p: p["status"].update(phase="Pending"),
        lambda p: p["status"].pop("podIP"),
        lambda p: p["metadata"].update(deletionTimestamp="2026-12-01T18:30:00Z"),
        lambda p: p["status"].update(phase="Succeeded"),
    ],
)
def test_only_running_pods_with_an_ip_that_are_not_terminating_are_engines(change):
    pod = _ready(make_pod("x", containers=[vllm_container()]))
    assert is_ready(pod)
    change(pod)
    assert not is_ready(pod)
    assert judge_pod(pod).engine is None and not judge_pod(pod).problems


def test_a_running_pod_failing_its_readiness_probe_is_an_engine_marked_not_ready():
    pod = _ready(make_pod("x", containers=[vllm_container()]))
    assert judge_pod(pod).engine is not None and judge_pod(pod).engine.ready
    pod["status"]["conditions"] = pod_conditions(False)
    engine = judge_pod(pod).engine
    assert not is_ready(pod) and engine is not None and not engine.ready


def test_a_pod_object_of_the_wrong_shape_is_a_problem_not_a_crash():
    verdict = judge_pod({"metadata": {"name": "x"}, "spec": {"containers": "not-a-list"}, "status": 5})
    assert verdict.engine is None


def test_an_sglang_container_is_recognised_by_its_launch_command_and_default_port():
    sglang = {
        "name": "server",
        "image": "registry.example.com/llm/server:1.2",
        "command": ["python3", "-m", "sglang.launch_server"],
        "args": ["--model-path", "Qwen/Qwen3-8B", "--enable-metrics"],
    }
    engine = judge_pod(_ready(make_pod("sgl", containers=[sglang]))).engine
    assert engine is not None and engine.backend == "sglang"
    assert engine.metrics_url == "http://10.1.2.3:30000/metrics"


def test_a_container_port_named_metrics_wins_over_the_arguments():
    container = {**vllm_container(8000), "ports": [{"name": "metrics", "containerPort": 9100}]}
    engine = judge_pod(_ready(make_pod("v", containers=[container]))).engine
    assert engine is not None and engine.metrics_url.endswith(":9100/metrics")


def _shell_wrapped(script: str, shell: list[str] | None = None, **extra) -> dict:
    """A container as vLLM's Kubernetes guide (docs/deployment/k8s.md) writes it: the command line is
    one shell script, ``command: ["/bin/sh", "-c"]``, ``args: ["vllm serve ... --port N"]``."""
    return {
        "name": "mistral-7b",
        "image": "registry.local/llm/engine:2026.11",
        "command": shell or ["/bin/sh", "-c"],
        "args": [script],
        "ports": [{"containerPort": 8000}],
        **extra,
    }


@pytest.mark.parametrize(
    ("shell", "script", "port"),
    [
        (None, "vllm serve mistralai/Mistral-7B-v0.3 --port 8080 --trust-remote-code", 8080),
        (None, "vllm serve mistralai/Mistral-7B-v0.3 --port=8081", 8081),
        (["bash", "-ec"], "pip install -q extra && exec vllm serve 'my model' --port 9000", 9000),
        # --port of the command before the engine's is not the engine's
        (
            ["/bin/sh", "-lc"],
            "python3 warmup.py --port 1234; python3 -m vllm.entrypoints.openai.api_server "
            '--model m --port "8200"',
            8200,
        ),
        (None, "vllm serve mistralai/Mistral-7B-v0.3 --trust-remote-code", 8000),  # vLLM's default
        # a YAML block script: a command a line (one command read --port 6379, ray's)
        (["bash", "-c"], "ray start --head --port=6379\nvllm serve m --port 8080\n", 8080),
        (None, "ray start --port=6379  # the head\nvllm serve m \\\n  --port 8090", 8090),
    ],
)
def test_a_shell_wrapped_command_line_is_read_as_the_shell_splits_it(shell, script, port):
    verdict = judge_pod(_ready(make_pod("mistral-0", containers=[_shell_wrapped(script, shell)])))
    assert verdict.engine is not None, verdict
    assert verdict.engine.metrics_url == f"http://10.1.2.3:{port}/metrics"
    assert verdict.engine.backend == "vllm"


def test_a_script_that_no_shell_could_parse_is_still_read_as_words():
    verdict = judge_pod(_ready(make_pod("m", containers=[_shell_wrapped("vllm serve 'm --port 8300")])))
    # shlex refuses the unbalanced quote; read as plain words, the engine and its --port are found
    assert verdict.engine is not None and verdict.engine.metrics_url.endswith(":8300/metrics")


def test_prometheus_annotations_set_port_and_path_below_kvwatchs_own():
    containers = [vllm_container(8000)]
    pod = make_pod(
        "q",
        containers=containers,
        annotations={
            "prometheus.io/scrape": "true",
            "prometheus.io/port": "8001",
            "prometheus.io/path": "/engine/metrics",
        },
    )
    engine = judge_pod(_ready(pod)).engine
    assert engine is not None and engine.metrics_url == "http://10.1.2.3:8001/engine/metrics"
    pod["metadata"]["annotations"].update({"kvwatch.io/port": "8002", "kvwatch.io/path": "/metrics"})
    engine = judge_pod(_ready(pod)).engine
    assert engine is not None and engine.metrics_url == "http://10.1.2.3:8002/metrics"


def test_prometheus_scrape_false_keeps_an_engine_out_unless_kvwatch_says_true():
    pod = make_pod("q", containers=[vllm_container()], annotations={"prometheus.io/scrape": "false"})
    assert judge_pod(_ready(pod)) == PodVerdict()
    pod["metadata"]["annotations"]["kvwatch.io/scrape"] = "true"
    assert judge_pod(_ready(pod)).engine is not None


def test_prometheus_scrape_true_alone_makes_no_engine_of_an_exporter():
    pod = make_pod(
        "node-exporter-x",
        annotations={"prometheus.io/scrape": "true", "prometheus.io/port": "9100"},
        containers=[{"name": "exporter", "image": "quay.io/prometheus/node-exporter:v1.9.0"}],
    )
    assert judge_pod(_ready(pod)) == PodVerdict()


def test_a_malformed_prometheus_port_on_an_engine_is_named():
    pod = make_pod("q", containers=[vllm_container()], annotations={"prometheus.io/port": "http"})
    verdict = judge_pod(_ready(pod))
    assert verdict.engine is None
    assert verdict.problems and verdict.problems[0][0] == "prometheus.io/port"


def test_port_arguments_from_the_containers_env_are_expanded_as_the_kubelet_and_shell_would():
    env = [{"name": "VLLM_PORT", "value": "8400"}, {"name": "SECRET", "valueFrom": {"secretKeyRef": {}}}]
    kubelet = {
        "name": "vllm",
        "image": "vllm/vllm-openai:v0.11.0",
        "env": env,
        "args": ["--model", "m", "--port", "$(VLLM_PORT)"],
    }
    engine = judge_pod(_ready(make_pod("a", containers=[kubelet]))).engine
    assert engine is not None and engine.metrics_url.endswith(":8400/metrics")
    escaped = {**kubelet, "args": ["--port", "$$(VLLM_PORT)"]}  # $$ escapes: the literal "$(VLLM_PORT)"
    engine = judge_pod(_ready(make_pod("b", containers=[escaped]))).engine
    assert engine is not None and engine.metrics_url.endswith(":8000/metrics")
    shell = _shell_wrapped("exec vllm serve m --port ${VLLM_PORT}", env=env)
    engine = judge_pod(_ready(make_pod("c", containers=[shell]))).engine
    assert engine is not None and engine.metrics_url.endswith(":8400/metrics")
    unknown = _shell_wrapped("vllm serve m --port $PORT_FROM_IMAGE", env=env)  # not in the pod: default
    engine = judge_pod(_ready(make_pod("d", containers=[unknown]))).engine
    assert engine is not None and engine.metrics_url.endswith(":8000/metrics")


@pytest.mark.parametrize("pod_ip", ["evil.example/x?", "10.1.2.3:9999/", "{'a': 1}", ""])
def test_a_pod_ip_that_is_no_ip_address_gives_no_metrics_url(pod_ip: str) -> None:
    """The API server validates status.podIP; a watch stream that did not must not choose where kvwatch
    connects (before, "evil.example/x?" became http://evil.example/x?:8100/metrics)."""
    pod = _ready(make_pod("qwen-0", containers=[vllm_container(8100)]), ip=pod_ip)
    verdict = judge_pod(pod)
    assert verdict.engine is None
    assert verdict.problems == ((("(pod)", "status.podIP is not an IP address"),) if pod_ip else ())


def test_a_named_container_port_out_of_range_is_no_port() -> None:
    container = {**vllm_container(8100), "ports": [{"name": "metrics", "containerPort": 70_000}]}
    pod = _ready(make_pod("qwen-0", annotations={"kvwatch.io/port": "metrics"}, containers=[container]))
    assert judge_pod(pod).problems == (("kvwatch.io/port", "no container port named 'metrics' in the pod"),)
