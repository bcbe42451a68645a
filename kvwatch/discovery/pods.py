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

The Prometheus convention's ``prometheus.io/scrape``, ``prometheus.io/port`` (a number) and
``prometheus.io/path`` are honoured below kvwatch's own (and KServe's, on a KServe pod):
``prometheus.io/scrape: "false"`` keeps a recognised engine out unless ``kvwatch.io/scrape`` is
``true``; ``"true"`` alone does not make an engine of a pod nothing else recognises (exporters carry it
too).

Command lines are read as the container runs them: ``command`` then ``args``, and a shell-wrapped one
(``sh -c "vllm serve ... --port 8080"``, the form vLLM's Kubernetes guide uses) is split as the shell
would (``shlex``), taking the command of the script that runs the engine; ``$(VAR)`` is expanded from
the container's env as the kubelet does, and a script's ``$VAR`` from the same env.

A container port named ``metrics`` on the engine container wins over the arguments. A pod is an
engine to scrape while it is Running, has a pod IP and is not being deleted; ``PodEngine.ready`` says
whether its ``Ready`` condition is ``True`` (whether to keep a not-ready one is the caller's call: it
knows which pods were targets before). A malformed annotation makes the pod a problem (named, never
guessed around).
"""

from __future__ import annotations

import ipaddress
import posixpath
import re
import shlex
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
PROM_SCRAPE, PROM_PORT, PROM_PATH = "prometheus.io/scrape", "prometheus.io/port", "prometheus.io/path"
LLMD_LABEL = "llm-d.ai/inferenceServing"
SHELLS = frozenset({"sh", "bash", "dash", "ash", "ksh", "zsh"})
#: a shell script longer than this is not split (searched as plain text for the engine only)
MAX_SCRIPT_CHARS = 64 * 1024
_CONTROL = frozenset(";&|()")  # shlex punctuation: tokens made of these separate commands
#: engines' own default ports; KServe's Hugging Face model server (vLLM inside) listens on 8080
DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000, "kserve-huggingfaceserver": 8080}
_PORT_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # IANA_SVC_NAME, as the API validates
_VLLM_LINE = re.compile(r"\bvllm serve\b|vllm\.entrypoints\.openai")
_SGLANG_LINE = re.compile(r"sglang\.launch_server|\bsglang serve\b")
_ENGINE_LINE = re.compile(f"{_VLLM_LINE.pattern}|{_SGLANG_LINE.pattern}")
_KUBELET_VAR = re.compile(r"\$\$|\$\(([^)]*)\)")  # expand.go: a name is anything up to the first ")"
_SHELL_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
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
    #: its Ready condition is True (False: Running but failing its readiness probe)
    ready: bool = True

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


def is_running(pod: Mapping[str, Any]) -> bool:
    """Running, a pod IP, not terminating: a pod whose containers can answer, ready or not."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return (
        not meta.get("deletionTimestamp") and status.get("phase") == "Running" and bool(status.get("podIP"))
    )


def is_ready(pod: Mapping[str, Any]) -> bool:
    """Running, ``Ready=True``, a pod IP, not terminating: what the API says of a serving pod."""
    if not is_running(pod):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(
        isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True" for c in conditions
    )


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
    if scrape is False or (scrape is None and _prometheus_scrape(annotations) is False):
        return PodVerdict(problems=tuple(problems))
    found = _recognise(labels, containers) if recognise or scrape else None
    if scrape is None and found is None:
        return PodVerdict(problems=tuple(problems))  # a bad annotation is said even on a pod left alone
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
    if not is_running(pod):
        return PodVerdict()
    try:  # the API server validates it; a watch stream that did not must not choose where kvwatch connects
        ip = ipaddress.ip_address(str((pod.get("status") or {}).get("podIP")))
    except ValueError:
        return PodVerdict(problems=(("(pod)", "status.podIP is not an IP address"),))
    host = f"[{ip}]" if ip.version == 6 else str(ip)
    namespace, name = pod_key(pod)
    return PodVerdict(
        PodEngine(
            namespace=namespace,
            pod=name,
            uid=str(meta.get("uid") or ""),
            metrics_url=f"http://{host}:{port}{path}",
            backend=backend,
            model_name=model,
            recognised_by=kind,
            container=str(container.get("name")) if container else None,
            ready=is_ready(pod),
        )
    )


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


def _prometheus_scrape(annotations: Mapping[str, str]) -> bool | None:
    """``prometheus.io/scrape``, read as Prometheus' keep-relabel reads it: "true" or not; None if unset."""
    raw = annotations.get(PROM_SCRAPE)
    return None if raw is None else raw.strip().lower() == "true"


def _backend(annotations: Mapping[str, str], problems: list[tuple[str, str]], kind: str) -> str:
    raw = annotations.get(BACKEND)
    if raw is None:
        return kind if kind in BACKENDS else "auto"
    value = raw.strip().lower()
    if value != "auto" and value not in BACKENDS:
        problems.append((BACKEND, f"unknown backend {raw[:64]!r} (one of auto, {', '.join(BACKENDS)})"))
    return value


def _path(annotations: Mapping[str, str], problems: list[tuple[str, str]], kind: str) -> str:
    key = next(
        (k for k in (PATH, KSERVE_PATH if kind == "kserve" else None, PROM_PATH) if k and annotations.get(k)),
        None,
    )
    if key is None:
        return "/metrics"
    raw = annotations[key]
    if not _PATH.match(raw):
        problems.append((key, f"expected an absolute URL path such as /metrics, got {raw[:64]!r}"))
    return raw


def _port(
    annotations: Mapping[str, str],
    problems: list[tuple[str, str]],
    kind: str,
    container: Mapping[str, Any] | None,
    containers: Sequence[Mapping[str, Any]],
) -> int | None:
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
    prometheus = annotations.get(PROM_PORT)
    if prometheus is not None:  # digits only, as the convention's relabel rule (regex \d+) takes it
        text = prometheus.strip()
        if text.isdigit() and 1 <= int(text) <= 65535:
            return int(text)
        problems.append((PROM_PORT, f"expected a port number 1..65535, got {prometheus[:64]!r}"))
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
            if isinstance(p, Mapping) and p.get("name") == name:
                number = _port_number(p.get("containerPort"))
                if number is not None:
                    return number
    return None


def _command_line(container: Mapping[str, Any]) -> list[str]:
    """The words the container runs: ``command`` + ``args`` with the kubelet's ``$(VAR)`` expansion,
    a shell's ``-c`` script split as it would, its ``$VAR`` / ``${VAR}`` taken from the same env."""
    argv = [str(a) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    env = _literal_env(container) if any("$" in a for a in argv) else {}  # most pods: no references
    argv = [_kubelet_expand(a, env) for a in argv] if env else argv
    script = _shell_script(argv)
    if script is None or len(script) > MAX_SCRIPT_CHARS:
        return argv
    if env:
        script = _SHELL_VAR.sub(lambda m: env.get(m["braced"] or m["bare"], m[0]), script)
    return _script_command(script)


def _literal_env(container: Mapping[str, Any]) -> dict[str, str]:
    """The container's env entries with a literal ``value`` (``valueFrom`` is not in the pod object)."""
    return {
        str(e["name"]): str(e["value"])
        for e in container.get("env") or []
        if isinstance(e, Mapping) and isinstance(e.get("name"), str) and isinstance(e.get("value"), str)
    }


def _kubelet_expand(arg: str, env: Mapping[str, str]) -> str:
    """``$(VAR)`` from the container's env, ``$$`` -> ``$``, unknown references left as they are: the
    expansion the kubelet applies to ``command`` and ``args`` (kubernetes'
    ``third_party/forked/golang/expansion/expand.go``)."""
    return _KUBELET_VAR.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), arg)


def _shell_script(argv: Sequence[str]) -> str | None:
    """The script of ``sh -c SCRIPT`` (also ``bash -ec``, ``/bin/sh -lc``...), else None."""
    if not argv or posixpath.basename(argv[0]) not in SHELLS:
        return None
    for i, arg in enumerate(argv[1:], 1):
        if not arg.startswith("-") or arg.startswith("--"):
            return None  # ``sh script.sh``: a file we cannot read
        if "c" in arg[1:]:
            return argv[i + 1] if i + 1 < len(argv) else None
    return None


def _script_command(script: str) -> list[str]:
    """The words of the script's command that runs an engine, else all its words. A newline ends a
    command as ``;`` does (a YAML block script runs a command a line), a backslash-newline does not."""
    joined = script.replace("\\\n", " ")
    try:
        commands = [command for line in joined.splitlines() for command in _commands(line)]
    except ValueError:  # a quote open across lines, or never closed: read the script as one
        try:
            commands = _commands(joined)
        except ValueError:  # the shell would refuse it too; read it as plain words
            commands = [joined.split()]
    words = [word for command in commands for word in command]
    return next((c for c in commands if _ENGINE_LINE.search(" ".join(c))), words)


def _commands(text: str) -> list[list[str]]:
    """``text``'s commands as words, split at ``;``, ``&``, ``|`` and parentheses (ValueError on an
    unbalanced quote)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if set(word) <= _CONTROL:
            commands.append([])
        else:
            commands[-1].append(word)
    return commands


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


def _port_number(value: Any) -> int | None:
    """A TCP port from a pod spec's number: 1..65535, an int but not a bool."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 65535 else None


def _engine_of(container: Mapping[str, Any]) -> str | None:
    image = str(container.get("image") or "").lower().rsplit("@", 1)[0]
    repository = image.rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image
    line = " ".join(_command_line(container))
    if "vllm" in repository or _VLLM_LINE.search(line):
        return "vllm"
    if "sglang" in repository or _SGLANG_LINE.search(line):
        return "sglang"
    if "huggingfaceserver" in repository:
        return "kserve-huggingfaceserver"
    return None


def _recognise(
    labels: Mapping[str, str],
    containers: Sequence[Mapping[str, Any]],
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
