"""The alerting stack of the end-to-end tests: ``kvwatch demo`` nodes, a real Prometheus with the
shipped rule files, a real Alertmanager routed like ``deploy/alertmanager/alertmanager.yml``, and a
webhook receiver (aiohttp, in a thread) that records what Alertmanager delivers.

Two nodes per metrics profile (``lean`` and ``full``), all four running at once, so the shipped
rules' minutes of ``for:`` are waited out once, not once per profile:

* ``pressure-<profile>``: the demo's default story (8 x Qwen3-32B, skewed router pinning half the
  long requests on replica-0).
* ``healthy-<profile>``: the same model, least-loaded routing, a tenth of the traffic, slower clock
  (see ``HEALTHY_ARGS``).

The per-band SLO rules aggregate ``by (cluster, model_name, length_band)``: requests of two nodes
would be summed into one ratio if they shared ``cluster`` and model, so each node's target label
``cluster`` is its name (a fleet of one node each), and every alert can be attributed to one demo
and one profile.

Prometheus scrapes and evaluates every ``INTERVAL``; the rules are the shipped files, unmodified, so
alerts keep their ``for:`` durations (2 minutes for pages), which is what the module's wall time is
planned around.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml
from aiohttp import web

from tests.local import log_tail, require_tool, serve_app, spawn_logged, wait_healthy

from .stack import ROOT, Prometheus, free_port, stop_group, wait_until

SHIPPED_ALERTMANAGER = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
INTERVAL = "5s"  # Prometheus scrape and rule evaluation
WEBHOOK_TOKEN = "e2e-webhook-token"  # read by Alertmanager from a file, as the shipped config does

#: the demo's default story; the seed fixes the workload (the wall clock still varies the details)
PRESSURE_ARGS = ("--seed", "0")
#: light traffic spread evenly: on 4 replicas KV usage stays under ~30% and nothing queues for long
#: (on 2 it reaches ~55%). --speed 5: a simulator tick is 0.25 simulated seconds, so a late tick on
#: a busy 2-core machine cannot push a short request's TTFT over the 2 s ttft-short threshold (at 20x
#: a tick is 1 s, up to 4 late ticks are caught up at once, and on a loaded machine a third of the
#: short requests measured TTFTs over 2 s: a false page).
#: 0.5 requests per wall second still put >= 20 requests into a band within ~2 minutes, past the
#: burn alerts' traffic guard.
HEALTHY_ARGS = ("--router", "least_loaded", "--rate", "0.1", "--replicas", "4", "--speed", "5", "--seed", "1")
#: the demos stop by themselves after this long even if nobody tears them down
DEMO_SAFETY_DURATION_S = 1200

_DEMO_URL = re.compile(r"metrics http://(127\.0\.0\.1:\d+)/metrics")


class Demo:
    """``python -m kvwatch demo`` on a free loopback port; its instance is read from its first line."""

    def __init__(self, name: str, args: tuple[str, ...], workdir: Path) -> None:
        self.name = name
        self.args = args
        self.stdout_path = workdir / f"demo-{name}.out"
        self.stderr_path = workdir / f"demo-{name}.err"
        self.proc: subprocess.Popen | None = None
        self.instance = ""  # host:port once started
        self.started = 0.0  # monotonic

    @property
    def replicas(self) -> int:
        return int(self.args[self.args.index("--replicas") + 1]) if "--replicas" in self.args else 8

    @property
    def url(self) -> str:
        return f"http://{self.instance}"

    def start(self) -> None:
        self.started = time.monotonic()
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvwatch",
                    "demo",
                    "--listen",
                    "127.0.0.1:0",
                    "--view",
                    "none",
                    "--duration",
                    str(DEMO_SAFETY_DURATION_S),
                    *self.args,
                ],
                cwd=ROOT,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        proc = self.proc
        assert proc is not None

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"demo {self.name} exited with {proc.returncode}:\n{self.tails()}")
            if not self.instance:
                found = _DEMO_URL.search(self.stdout_path.read_text(errors="replace"))
                if not found:
                    return False
                self.instance = found.group(1)
            return httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200

        wait_until(ready, timeout_s, f"demo {self.name} /-/ready", interval_s=0.5)

    def tails(self) -> str:
        return (
            f"--- demo {self.name} stdout ---\n{log_tail(self.stdout_path, 1500)}\n"
            f"--- demo {self.name} stderr ---\n{log_tail(self.stderr_path)}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM, 20.0)


# -- Alertmanager ----------------------------------------------------------------------------------


def _short_timers(route: dict[str, Any], root: bool = True) -> dict[str, Any]:
    """The route tree with group_wait 1s / group_interval 5s at the root and wherever a child sets one."""
    out = dict(route)
    for key, value in (("group_wait", "1s"), ("group_interval", "5s")):
        if root or key in out:
            out[key] = value
    if "routes" in out:
        out["routes"] = [_short_timers(r, root=False) for r in out["routes"]]
    return out


def alertmanager_config(shipped: dict[str, Any], webhook_url: str, token_file: Path) -> dict[str, Any]:
    """The shipped routing, grouping and inhibitions, with short timers; every receiver keeps only
    its webhook (PagerDuty and Slack cannot be reached from a test), pointed at ``webhook_url``/NAME
    with the bearer token read from ``token_file``."""
    config = copy.deepcopy(shipped)
    config["route"] = _short_timers(config["route"])
    receivers = []
    for receiver in config["receivers"]:
        hooks = receiver.get("webhook_configs")
        assert hooks, f"receiver {receiver['name']} of {SHIPPED_ALERTMANAGER} has no webhook to redirect"
        redirected = []
        for shipped_hook in hooks:
            hook = copy.deepcopy(shipped_hook)
            hook["url"] = f"{webhook_url}/{receiver['name']}"
            auth = hook.get("http_config", {}).get("authorization")
            if auth is not None:
                auth["credentials_file"] = str(token_file)
            redirected.append(hook)
        receivers.append({"name": receiver["name"], "webhook_configs": redirected})
    config["receivers"] = receivers
    return config


class Alertmanager:
    """``prometheus-alertmanager`` on loopback, clustering off, config from ``alertmanager_config``."""

    def __init__(self, workdir: Path, config: dict[str, Any]) -> None:
        self.workdir = workdir / "alertmanager"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = self.workdir / "alertmanager.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = self.workdir / "alertmanager.log"
        self.proc: subprocess.Popen | None = None

    def start(self, ready_timeout_s: float = 60.0) -> None:
        alertmanager = require_tool("prometheus-alertmanager", path_env="KVWATCH_ALERTMANAGER")
        argv = [
            alertmanager,
            f"--config.file={self.config_path}",
            f"--storage.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ]
        self.proc = spawn_logged(argv, self.log_path)
        wait_healthy(f"{self.url}/-/ready", self.proc.pid, ready_timeout_s, self.log_path, "alertmanager")

    def alerts(self) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.url}/api/v2/alerts", timeout=10)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        if self.proc is not None:
            stop_group(self.proc, signal.SIGTERM, 10.0)


# -- webhook receiver ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Delivery:
    """One POST from Alertmanager: the path names the receiver the route picked."""

    path: str
    authorization: str
    payload: dict[str, Any]
    received_at: float  # monotonic


class WebhookReceiver:
    """An aiohttp server on its own event loop in a thread; ``deliveries()`` is safe to call anytime."""

    def __init__(self) -> None:
        self._deliveries: list[Delivery] = []
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="e2e-webhook", daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _handle(self, request: web.Request) -> web.Response:
        payload = await request.json()
        with self._lock:
            self._deliveries.append(
                Delivery(request.path, request.headers.get("Authorization", ""), payload, time.monotonic())
            )
        return web.Response(text="ok")

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/{receiver}", self._handle)
        self._runner, port = await serve_app(app, access_log=None)
        return f"http://127.0.0.1:{port}"

    def start(self) -> None:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    def deliveries(self) -> list[Delivery]:
        with self._lock:
            return list(self._deliveries)

    def stop(self) -> None:
        if self._thread.is_alive():
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
        if not self._loop.is_closed() and not self._loop.is_running():
            self._loop.close()


def delivered_alerts(deliveries: list[Delivery]) -> list[tuple[Delivery, dict[str, Any]]]:
    """Every alert of every delivery, with the delivery it came in."""
    return [(d, alert) for d in deliveries for alert in d.payload.get("alerts", [])]


# -- the stack -------------------------------------------------------------------------------------


PROFILES = ("lean", "full")  # the metrics.profile values; each gets its own pair of demo nodes


@dataclass(frozen=True, slots=True)
class NodePair:
    """One metrics profile's demos: the pressure story and the healthy node."""

    pressure: Demo
    healthy: Demo


def _demos_of(pairs: dict[str, NodePair]) -> list[Demo]:
    return [demo for pair in pairs.values() for demo in (pair.pressure, pair.healthy)]


@dataclass
class AlertingStack:
    pairs: dict[str, NodePair]  # metrics.profile -> its demos
    prometheus: Prometheus
    alertmanager: Alertmanager
    webhook: WebhookReceiver
    workdir: Path
    started: float  # monotonic: when the first demo started
    profile: str = PROFILES[0]  # whose demos ``pressure`` and ``healthy`` are
    stopped: bool = False

    @property
    def pressure(self) -> Demo:
        return self.pairs[self.profile].pressure

    @property
    def healthy(self) -> Demo:
        return self.pairs[self.profile].healthy

    def demos(self) -> list[Demo]:
        return _demos_of(self.pairs)

    def seen_as(self, profile: str) -> AlertingStack:
        """The same running stack, its ``pressure`` and ``healthy`` those of ``profile``."""
        return replace(self, profile=profile)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def query(self, expr: str) -> list[dict[str, Any]]:
        return self.prometheus.query(expr)

    def value(self, expr: str) -> float | None:
        """The single value of an instant query (None when it returns nothing)."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def diagnostics(self) -> str:
        """What to look at when an end-to-end assertion fails (never raises)."""
        parts = [f"stack up for {self.elapsed():.0f} s; files under {self.workdir}"]
        with contextlib.suppress(Exception):
            alerts = self.prometheus.alerts()
            lines = [
                f"  {a['state']:8} {a['labels'].get('alertname')} since {a.get('activeAt')} "
                f"{ {k: v for k, v in a['labels'].items() if k != 'alertname'} } value {a.get('value')}"
                for a in alerts
            ]
            parts.append("Prometheus alerts:\n" + ("\n".join(lines) or "  (none)"))
        with contextlib.suppress(Exception):
            errors = self.prometheus.rule_errors()
            parts.append("rule evaluation errors:\n  " + ("\n  ".join(errors) or "(none)"))
        with contextlib.suppress(Exception):
            targets = self.prometheus.api("targets")["activeTargets"]
            parts.append(
                "targets:\n"
                + "\n".join(
                    f"  {t['labels'].get('cluster')} {t['scrapeUrl']} {t['health']} {t.get('lastError', '')}"
                    for t in targets
                )
            )
        with contextlib.suppress(Exception):
            parts.append(
                "SLO error ratios (30m window) over 0.01:\n"
                + "\n".join(
                    f"  {r['metric']} {r['value'][1]}"
                    for r in self.query("kvwatch:slo_errors:ratio_rate30m > 0.01")
                )
            )
        with contextlib.suppress(Exception):
            parts.append(
                "Alertmanager alerts:\n"
                + "\n".join(f"  {a['status']['state']} {a['labels']}" for a in self.alertmanager.alerts())
            )
        deliveries = self.webhook.deliveries()
        parts.append(
            f"webhook deliveries: {len(deliveries)}\n"
            + "\n".join(f"  {d.path} {a['status']} {a['labels']}" for d, a in delivered_alerts(deliveries))
        )
        parts.append(f"--- alertmanager log ---\n{log_tail(self.alertmanager.log_path, 1500)}")
        parts.append(f"--- prometheus log ---\n{log_tail(self.prometheus.log_path, 1500)}")
        parts += [demo.tails() for demo in self.demos()]
        return "\n".join(parts)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        for stop in (
            *(demo.stop for demo in self.demos()),
            self.prometheus.stop,
            self.alertmanager.stop,
            self.webhook.stop,
        ):
            with contextlib.suppress(Exception):
                stop()


def _prometheus(workdir: Path, demos: list[Demo], alertmanager: Alertmanager) -> Prometheus:
    """Prometheus scraping the demos as job ``kvwatch``, one ``cluster`` label each, alerting to
    ``alertmanager``; its rule files are the shipped ones."""
    job = {
        "job_name": "kvwatch",
        "static_configs": [{"targets": [d.instance], "labels": {"cluster": d.name}} for d in demos],
    }
    alerting = {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{alertmanager.port}"]}]}]}
    return Prometheus(
        workdir, [], interval=INTERVAL, extra_scrape_configs=[job], extra_config={"alerting": alerting}
    )


def start_alerting_stack(workdir: Path) -> AlertingStack:
    """Start everything (demos first: they take longest); stop what started if a step fails."""
    pairs = {
        profile: NodePair(
            Demo(f"pressure-{profile}", (*PRESSURE_ARGS, "--metrics-profile", profile), workdir),
            Demo(f"healthy-{profile}", (*HEALTHY_ARGS, "--metrics-profile", profile), workdir),
        )
        for profile in PROFILES
    }
    demos = _demos_of(pairs)
    webhook = WebhookReceiver()
    token_file = workdir / "webhook-token"
    token_file.write_text(WEBHOOK_TOKEN)
    started: list[Demo | WebhookReceiver | Alertmanager | Prometheus] = []
    try:
        for part in (*demos, webhook):
            started.append(part)
            part.start()
        shipped = yaml.safe_load(SHIPPED_ALERTMANAGER.read_text())
        alertmanager = Alertmanager(workdir, alertmanager_config(shipped, webhook.url, token_file))
        started.append(alertmanager)
        alertmanager.start()
        for demo in demos:
            demo.wait_ready()
        prometheus = _prometheus(workdir, demos, alertmanager)
        started.append(prometheus)
        prometheus.start()
    except BaseException:
        for part in started:
            with contextlib.suppress(Exception):
                part.stop()
        raise
    return AlertingStack(pairs, prometheus, alertmanager, webhook, workdir, started=demos[0].started)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)
