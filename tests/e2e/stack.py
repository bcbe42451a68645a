"""Real processes for the end-to-end tests, and an independent reading of kvwatch's exposition.

* ``KvwatchRun``: the real ``kvwatch run --config FILE`` CLI as a subprocess (own session, log file).
* ``Prometheus``: Debian's ``/usr/bin/prometheus`` on loopback with a temp TSDB, short scrape and
  rule intervals, the shipped rule files as they are.
* ``LlamaServer``: a llama-server of the test's own (to kill and restart), same binary and model as
  the session's ``real_llamacpp``.
* ``parse``/``total``: the exposition read with prometheus_client's parser, not kvwatch's encoder.

Every process is started in its own session and stopped (whole group, SIGKILL after a grace
period) by ``stop()``; the fixtures call it in ``finally`` so a failing test leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.catalog import BY_NAME
from tests.local import free_port, require_tool, spawn_logged, wait_healthy
from tests.local import stop_group as local_stop_group
from tests.local import wait_until as local_wait_until

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_RULES = tuple(sorted((ROOT / "alerts").glob("*.rules.yaml")))

T = TypeVar("T")


#: what a probe of a server that is still starting may raise: counted as "not yet"
STARTING = (httpx.HTTPError, OSError, ValueError, KeyError)


def wait_until(probe: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.2) -> T:
    """``tests.local.wait_until`` with the e2e servers' start-up errors counted as "not yet"."""
    return local_wait_until(probe, timeout_s, what, interval_s, retry_on=STARTING)


# -- the exposition, read independently -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def parse(text: str) -> list[Sample]:
    return [
        Sample(s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def select(samples: Iterable[Sample], name: str, **labels: str) -> list[Sample]:
    return [s for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]


def total(samples: Iterable[Sample], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when there are none)."""
    return sum(s.value for s in select(samples, name, **labels))


def one(samples: Iterable[Sample], name: str, **labels: str) -> float:
    (found,) = select(samples, name, **labels)
    return found.value


def family_of(name: str) -> str:
    """The family a wire name belongs to (``x_bucket`` -> ``x``, ``x_total`` -> ``x``; a gauge named
    ``x_info``, as prometheus_client's ``python_info``, is its own family)."""
    if name in BY_NAME:
        return name
    for suffix in ("_bucket", "_count", "_sum", "_total", "_info", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


# -- processes -------------------------------------------------------------------------------------


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 10.0) -> int | None:
    """``tests.local.stop_group`` for a child of this process: its exit code once reaped."""
    if proc.poll() is None:
        local_stop_group(proc.pid, grace_s, sig)
        proc.wait(timeout=10)
    return proc.returncode


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (the relay workers, the parse worker), from /proc's children lists."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                todo.extend(int(child) for child in children.read_text().split())
    return tree


def _vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def rss_bytes(pid: int) -> int:
    """Resident bytes of the process and its live descendants: the agent's relay workers are part of
    what it costs a node."""
    total = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # a descendant that exits between the listing and the read
            total += _vm_rss(member)
    return total


def _stat_times(pid: int) -> list[int]:
    """utime, stime, cutime, cstime in clock ticks (``proc(5)``, fields 14-17)."""
    return [int(f) for f in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11:15]]


def cpu_seconds(pid: int) -> float:
    """CPU time of the process, of its reaped children, and of its live descendants."""
    utime, stime, cutime, cstime = _stat_times(pid)
    ticks = utime + stime + cutime + cstime
    for member in process_tree(pid)[1:]:
        with contextlib.suppress(OSError):
            ticks += sum(_stat_times(member)[:2])
    return ticks / os.sysconf("SC_CLK_TCK")


class KvwatchRun:
    """``python -m kvwatch run --config FILE --listen 127.0.0.1:PORT`` with ``config`` as YAML."""

    def __init__(self, config: dict[str, Any], workdir: Path, name: str = "kvwatch") -> None:
        self.config = config
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self, ready_timeout_s: float = 60.0) -> KvwatchRun:
        argv = [sys.executable, "-m", "kvwatch", "run", "--config", str(self.config_path)]
        self.proc = spawn_logged([*argv, "--listen", f"127.0.0.1:{self.port}"], self.log_path, cwd=ROOT)
        wait_healthy(f"{self.url}/-/ready", self.proc.pid, ready_timeout_s, self.log_path, "kvwatch run")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.url}/metrics", timeout=10)
        response.raise_for_status()
        return response.text

    def metrics(self) -> list[Sample]:
        return parse(self.metrics_text())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, sig: int = signal.SIGTERM, grace_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        return stop_group(self.proc, sig, grace_s)


class Prometheus:
    """A real Prometheus scraping ``targets`` as job ``job`` every ``interval``, evaluating
    ``rule_files`` (default: the shipped ``alerts/*.rules.yaml``, unmodified) on the same interval."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        *,
        job: str = "kvwatch",
        interval: str = "1s",
        rule_files: Iterable[Path] = SHIPPED_RULES,
        extra_scrape_configs: Iterable[dict] = (),
        external_labels: dict[str, str] | None = None,
        extra_config: dict | None = None,
        name: str = "prometheus",
        extra_args: Iterable[str] = (),
    ) -> None:
        self.workdir = workdir / name
        self.extra_args = tuple(extra_args)  # e.g. --enable-feature=native-histograms
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.workdir / "prometheus.log"
        self.proc: subprocess.Popen | None = None
        scrape = [{"job_name": job, "static_configs": [{"targets": targets}]}] if targets else []
        config = {
            "global": {
                "scrape_interval": interval,
                "evaluation_interval": interval,
                "scrape_timeout": interval,
                **({"external_labels": external_labels} if external_labels else {}),
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [*scrape, *extra_scrape_configs],
            **(extra_config or {}),
        }
        self.config_path = self.workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self, ready_timeout_s: float = 60.0) -> Prometheus:
        prometheus = require_tool("prometheus", path_env="KVWATCH_PROMETHEUS")
        argv = [
            prometheus,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
            *self.extra_args,
        ]
        self.proc = spawn_logged(argv, self.log_path)
        wait_healthy(f"{self.url}/-/ready", self.proc.pid, ready_timeout_s, self.log_path, "prometheus")
        return self

    def api(self, path: str, **params: Any) -> Any:
        response = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        response.raise_for_status()
        body = response.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.api("query", query=expr)["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return self.api("alerts")["alerts"]

    def evaluated_after(self, moment: float) -> bool:
        """Every rule group on the global evaluation interval (not one with a longer interval of its
        own) has finished an evaluation that started after ``moment`` (Unix time)."""
        groups = self.api("rules")["groups"]
        fastest = min((g["interval"] for g in groups), default=0)
        return bool(groups) and all(
            datetime.fromisoformat(g["lastEvaluation"]).timestamp() > moment
            for g in groups
            if g["interval"] == fastest
        )

    def rule_errors(self) -> list[str]:
        """Rules whose last evaluation failed (a rule file Prometheus could load but not evaluate)."""
        return [
            f"{r['name']}: {r['lastError']}"
            for g in self.api("rules")["groups"]
            for r in g["rules"]
            if r.get("lastError")
        ]

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM, 15.0)


class LlamaServer:
    """A llama-server of the test's own: ``binary`` and ``model`` from a running one's command line."""

    def __init__(
        self, binary: str, model: str, args: Iterable[str], workdir: Path, name: str = "llama"
    ) -> None:
        self.binary = binary
        self.model = model
        self.args = tuple(args)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    @classmethod
    def like(cls, pid: int, args: Iterable[str], workdir: Path, name: str = "llama") -> LlamaServer:
        """Same binary and ``-m`` model as the llama-server running as ``pid``."""
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        words = [a.decode() for a in argv if a]
        return cls(words[0], words[words.index("-m") + 1], args, workdir, name)

    def start(self, timeout_s: float = 60.0) -> LlamaServer:
        argv = [self.binary, "-m", self.model, "--host", "127.0.0.1", "--port", str(self.port)]
        self.proc = spawn_logged([*argv, "--metrics", "--slots", "-t", "1", *self.args], self.log_path)
        wait_healthy(f"{self.base_url}/health", self.proc.pid, timeout_s, self.log_path, "llama-server")
        return self

    def kill(self) -> None:
        """SIGKILL: the engine dies as in a crash (no graceful shutdown)."""
        if self.proc is not None:
            stop_group(self.proc, signal.SIGKILL, 10.0)

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM, 10.0)

    def busy_slots(self) -> int:
        slots = httpx.get(f"{self.base_url}/slots", timeout=5).json()
        return sum(1 for s in slots if s.get("is_processing"))


class RecordingRelay:
    """A pass-through in front of an engine's ``/metrics`` (``relay.py``, its own process) that keeps
    every page it served, stamped with the wall-clock time the request arrived: which page a kvwatch
    scrape read, exactly, instead of guessing from scrapes of our own taken before and after it."""

    def __init__(self, upstream: str, workdir: Path) -> None:
        self.upstream = upstream
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        self.pages_path = workdir / "relay-pages.jsonl"
        self.proc: subprocess.Popen | None = None

    def start(self) -> RecordingRelay:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("relay.py")),
                self.upstream,
                str(self.port),
                str(self.pages_path),
            ],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        wait_until(self.pages_path.exists, 30, "the relay to listen")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc)

    def pages_between(self, started: float, ended: float) -> list[str]:
        """The pages served to requests that arrived from ``started`` to ``ended``, in order."""
        pages = (json.loads(line) for line in self.pages_path.read_text().splitlines())
        return [page["text"] for page in pages if started <= page["arrived"] <= ended]
