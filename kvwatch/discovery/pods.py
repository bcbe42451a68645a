"""Which pods are engines, and where their metrics are. Pure: a pod object (API JSON) in, a verdict out.

Annotations (all optional, on the pod, i.e. the pod template):

| annotation | value | default |
|---|---|---|
| ``kvwatch.io/scrape`` | ``true`` / ``false`` | recognised engines are scraped; ``false`` excludes one |
| ``kvwatch.io/port`` | metrics port: a number or a container port name | from the engine's arguments |
| ``kvwatch.io/path`` | metrics path | ``/metrics`` |
| ``kvwatch.io/backend`` | ``auto`` or an engine (``vllm``, ``sglang``, ...) | ``auto`` (read from the page) |
| ``kvwatch.io/model`` | model name for engines whose page has none (llama.cpp, TGI) | none |

Without ``kvwatch.io/scrape`` a pod is recognised as an engine when one of its containers is:

- **vLLM**: the image name contains ``vllm``, or the command line runs ``vllm serve`` or
  ``vllm.entrypoints.openai.api_server``; port from ``--port`` (vLLM's default 8000);
- **SGLang**: the image name contains ``sglang``, or the command line runs ``sglang.launch_server``
  or ``sglang serve``; port from ``--port`` (SGLang's default 30000; SGLang serves /metrics only
  with ``--enable-metrics``);
- **KServe**: the pod has the label ``serving.kserve.io/inferenceservice`` (set by KServe on every
  predictor pod); its container ``kserve-container``; port from KServe's own
  ``prometheus.kserve.io/port`` / ``prometheus.kserve.io/path`` annotations, else the arguments;
- **llm-d**: the pod has the label ``llm-d.ai/inferenceServing: "true"`` (llm-d's model-server
  pods, with ``llm-d.ai/model`` and ``llm-d.ai/role``); the container that runs vLLM (llm-d's decode
  pods run vLLM on ``--port 8200`` behind a routing sidecar on 8000: the argument wins).

A container port named ``metrics`` on the engine container wins over the arguments. A pod is a
replica only while it is Running, its ``Ready`` condition is ``True``, it has a pod IP and is not
being deleted. A malformed annotation makes the pod a problem (named, never guessed around).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvwatch.model import BACKENDS
from kvwatch.safetext import terminal_safe

PREFIX = "kvwatch.io/"
SCRAPE, PORT, PATH, BACKEND, MODEL = (f"{PREFIX}{k}" for k in ("scrape", "port", "path", "backend", "model"))
KSERVE_LABEL = "serving.kserve.io/inferenceservice"
KSERVE_CONTAINER = "kserve-container"
KSERVE_PORT, KSERVE_PATH = "prometheus.kserve.io/port", "prometheus.kserve.io/path"
LLMD_LABEL = "llm-d.ai/inferenceServing"
#: engines' own default ports; KServe's Hugging Face model server (vLLM inside) listens on 8080
DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000, "kserve-huggingfaceserver": 8080}
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # IANA_SVC_NAME, as the API validates
_PATH = re.compile(r"^/[A-Za-z0-9._~!$&'()*+,;=:@%/-]{0,255}$")


@dataclass(frozen=True, slots=True)
class PodEngine:
    """A pod to scrape: one replica named ``namespace/pod``."""

    namespace: str
    pod: str
    uid: str
    metrics_url: str
    backend: str = "auto"
    model_name: str | None = None
    #: annotation | vllm | sglang | kserve-huggingfaceserver | kserve | llm-d
    recognised_by: str = "annotation"
    container: str | None = None

    @property
    def replica(self) -> str:
        return f"{self.namespace}/{self.pod}"


@dataclass(frozen=True, slots=True)
class PodVerdict:
    """``engine`` when the pod is a ready engine; ``problems`` (annotation, reason) when it is not
    because its annotations are wrong; both empty when it is simply not (yet) an engine."""

    engine: PodEngine | None = None
    problems: tuple[tuple[str, str], ...] = ()


def pod_key(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, ``Ready=True``, a pod IP, not terminating: what the API says of a serving pod."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    conditions = status.get("conditions") or []
    return any(isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
               for c in conditions)


def judge_pod(pod: Mapping[str, Any], recognise: bool = True) -> PodVerdict:
    """The verdict on one pod object; never raises on odd input (it came from outside)."""
    try:
        return _judge(pod, recognise)
    except (AttributeError, TypeError, ValueError) as exc:
        return PodVerdict(problems=(("(pod)", f"unreadable pod object: {exc}"),))


def _judge(pod: Mapping[str, Any], recognise: bool) -> PodVerdict:
    meta = pod.get("metadata") or {}
    annotations = _str_map(meta.get("annotations"))
    labels = _str_map(meta.get("labels"))
    containers = [c for c in (pod.get("spec") or {}).get("containers") or [] if isinstance(c, Mapping)]
    problems: list[tuple[str, str]] = []
    scrape = _scrape(annotations, problems)
    if scrape is False:
        return PodVerdict(problems=tuple(problems))
    found = _recognise(labels, containers) if recognise or scrape else None
    if scrape is None and found is None:
        return PodVerdict()
    kind, container = found if found is not None else ("annotation", containers[0] if containers else None)
    engine = _engine_of(container) if container is not None else None
    backend = _backend(annotations, problems, engine or kind)
    path = _path(annotations, problems, kind)
    port = _port(annotations, problems, kind, container, containers)
    model = terminal_safe(annotations.get(MODEL) or "") or None  # a label value: no raw control characters
    if problems:
        return PodVerdict(problems=tuple(problems))
    if port is None:
        return PodVerdict(problems=((PORT, "no metrics port: set kvwatch.io/port to a number or port name"),))
    if not is_ready(pod):
        return PodVerdict()
    ip = str((pod.get("status") or {}).get("podIP"))
    host = f"[{ip}]" if ":" in ip else ip
    namespace, name = pod_key(pod)
    return PodVerdict(PodEngine(
        namespace=namespace, pod=name, uid=str(meta.get("uid") or ""),
        metrics_url=f"http://{host}:{port}{path}", backend=backend, model_name=model,
        recognised_by=kind, container=str(container.get("name")) if container else None))


def _str_map(node: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in node.items()} if isinstance(node, Mapping) else {}


def _scrape(annotations: Mapping[str, str], problems: list[tuple[str, str]]) -> bool | None:
    raw = annotations.get(SCRAPE)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    problems.append((SCRAPE, f"expected true or false, got {raw[:64]!r}"))
    return None


def _backend(annotations: Mapping[str, str], problems: list[tuple[str, str]], kind: str) -> str:
    raw = annotations.get(BACKEND)
    if raw is None:
        return kind if kind in BACKENDS else "auto"
    value = raw.strip().lower()
    if value != "auto" and value not in BACKENDS:
        problems.append((BACKEND, f"unknown backend {raw[:64]!r} (one of auto, {', '.join(BACKENDS)})"))
    return value


def _path(annotations: Mapping[str, str], problems: list[tuple[str, str]], kind: str) -> str:
    raw = annotations.get(PATH) or (annotations.get(KSERVE_PATH) if kind == "kserve" else None)
    if raw is None:
        return "/metrics"
    if not _PATH.match(raw):
        problems.append((PATH, f"expected an absolute URL path such as /metrics, got {raw[:64]!r}"))
    return raw


def _port(annotations: Mapping[str, str], problems: list[tuple[str, str]], kind: str,
          container: Mapping[str, Any] | None, containers: Sequence[Mapping[str, Any]]) -> int | None:
    raw = annotations.get(PORT) or (annotations.get(KSERVE_PORT) if kind == "kserve" else None)
    if raw is not None:
        text = raw.strip()
        if text.isdigit():
            number = int(text)
            if 1 <= number <= 65535:
                return number
            problems.append((PORT, f"port {number} out of range 1..65535"))
            return None
        if _PORT_NAME.match(text):
            named = _named_port(containers, text)
            if named is None:
                problems.append((PORT, f"no container port named {text!r} in the pod"))
            return named
        problems.append((PORT, f"expected a port number or a container port name, got {raw[:64]!r}"))
        return None
    if container is None:
        return None
    named = _named_port([container], "metrics")
    if named is not None:
        return named
    argument = _port_argument(_command_line(container))
    if argument is not None:
        return argument
    engine = _engine_of(container)
    return DEFAULT_PORTS.get(engine) if engine else None


def _named_port(containers: Sequence[Mapping[str, Any]], name: str) -> int | None:
    for c in containers:
        for p in c.get("ports") or []:
            if isinstance(p, Mapping) and p.get("name") == name and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


def _command_line(container: Mapping[str, Any]) -> list[str]:
    return [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]


def _port_argument(argv: Sequence[str]) -> int | None:
    """``--port N`` / ``--port=N`` (vLLM and SGLang), ``--http_port`` (KServe's model servers)."""
    for i, arg in enumerate(argv):
        for flag in ("--port", "--http_port", "--http-port"):
            value = None
            if arg == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif arg.startswith(f"{flag}="):
                value = arg.split("=", 1)[1]
            if value is not None and value.strip().isdigit() and 1 <= int(value) <= 65535:
                return int(value)
    return None


def _engine_of(container: Mapping[str, Any]) -> str | None:
    image = str(container.get("image") or "").lower().rsplit("@", 1)[0]
    repository = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    line = " ".join(_command_line(container))
    if "vllm" in repository or re.search(r"\bvllm serve\b|vllm\.entrypoints\.openai", line):
        return "vllm"
    if "sglang" in repository or re.search(r"sglang\.launch_server|\bsglang serve\b", line):
        return "sglang"
    if "huggingfaceserver" in repository:
        return "kserve-huggingfaceserver"
    return None


def _recognise(labels: Mapping[str, str], containers: Sequence[Mapping[str, Any]],
               ) -> tuple[str, Mapping[str, Any] | None] | None:
    """(how it was recognised, the engine container), or None for a pod that is no known engine."""
    engine = next((c for c in containers if _engine_of(c)), None)
    if KSERVE_LABEL in labels:
        # KServe serves every kind of model; only predictors that run an LLM engine are replicas
        main = next((c for c in containers if c.get("name") == KSERVE_CONTAINER), None)
        main = main if main is not None and _engine_of(main) else engine
        return ("kserve", main) if main is not None else None
    if labels.get(LLMD_LABEL, "").lower() == "true":
        return "llm-d", engine if engine is not None else (containers[0] if containers else None)
    if engine is not None:
        return str(_engine_of(engine)), engine
    return None
