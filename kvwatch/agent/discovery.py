"""Kubernetes discovery wired into the agent: this node's pods -> replicas named ``namespace/pod``.

The watch (``kvwatch.discovery.kube_api.PodWatch``) keeps the pod set; after every change each pod
is judged (``kvwatch.discovery.pods.judge_pod``) and the agent gets the whole replica list, which
it diffs against its scrape jobs. A pod becomes a replica once it is Ready; after that it stays one
while it is Running, ready or not (an overloaded engine failing its readiness probe is the one to
watch: its series and counters go on), as Prometheus' pod discovery keeps such a target with
``__meta_kubernetes_pod_ready="false"``; ``kvwatch_discovery_replica_ready`` says which. A pod that
is deleted, stops running or leaves the node drops out, and its series with it. While the API is
unreachable the last replicas stay (marked stale: ``kvwatch_discovery_stale 1``); a pod that really
went away then just fails its scrapes.

With ``vllm_plugin_dir`` set, each replica whose pod has a directory there (``<dir>/<pod uid>``,
``kvwatch.discovery.plugin_dir``) also gets a vLLM plugin socket: ``set_plugin_sockets`` is handed
the whole list after each change, as ``set_replicas`` is.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from kvwatch.config import Config, ReplicaConfig, VllmPluginSocketConfig
from kvwatch.derive.gpu_mapping import TERMINAL_PHASES
from kvwatch.discovery.kube_api import ApiError, Pods, PodWatch
from kvwatch.discovery.plugin_dir import plugin_sockets
from kvwatch.discovery.pods import PodEngine, PodVerdict, judge_pod, pod_key
from kvwatch.state import DiscoveryStatus, NodeState
from kvwatch.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def replica_config(engine: PodEngine) -> ReplicaConfig:
    return ReplicaConfig(
        name=engine.replica,
        metrics_url=engine.metrics_url,
        backend=engine.backend,
        model_name=engine.model_name,
    )


class PodDiscovery:
    """Runs the pod watch and hands ``set_replicas`` the discovered replicas after each change."""

    def __init__(
        self,
        config: Config,
        state: NodeState,
        set_replicas: Callable[[tuple[ReplicaConfig, ...]], None],
        environ: Mapping[str, str] | None = None,
        set_plugin_sockets: Callable[[tuple[VllmPluginSocketConfig, ...]], None] | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self._set_replicas = set_replicas
        self._set_plugin_sockets = set_plugin_sockets
        self._plugin_sockets: tuple[VllmPluginSocketConfig, ...] = ()
        self._problems: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        self._replicas: tuple[ReplicaConfig, ...] = ()
        #: replica name -> its pod is Ready; the uids of the pods that are replicas now
        self._ready: dict[str, bool] = {}
        self._targets: set[str] = set()
        #: uid -> (resourceVersion, verdict): a pod is judged again only when it changed
        self._verdicts: dict[str, tuple[str, PodVerdict]] = {}
        self._stale = True
        self.watch = PodWatch(
            config.discovery.kubernetes,
            config.node,
            self.on_pods,
            state.count,
            state.report,
            environ=environ,
            on_stale=self.on_stale,
        )
        self._task: asyncio.Task[Any] | None = None
        state.discovery = DiscoveryStatus()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubernetes-pod-watch")

    async def _run(self) -> None:
        try:
            await self.watch.run()
        except asyncio.CancelledError:
            raise
        except ApiError as exc:  # no API server to talk to at all (not in a cluster, no api_url)
            log.error("kubernetes discovery cannot start: %s", exc)
            self.state.report("kubernetes", False, 0.0, str(exc))
        except Exception:  # a bug here must not stop the agent; it shows as a failed collector
            log.exception("kubernetes discovery stopped")
            self.state.report("kubernetes", False, 0.0, "discovery stopped (see log)")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def on_stale(self, stale: bool) -> None:
        self._stale = stale
        self._publish()

    def on_pods(self, pods: Pods) -> None:
        recognise = self.config.discovery.kubernetes.recognise
        replicas: list[ReplicaConfig] = []
        engines: list[PodEngine] = []
        problems: dict[tuple[str, str], tuple[tuple[str, str], ...]] = {}
        verdicts: dict[str, tuple[str, PodVerdict]] = {}
        ready: dict[str, bool] = {}
        targets: set[str] = set()
        for uid, pod in pods.items():
            version = str((pod.get("metadata") or {}).get("resourceVersion") or "")
            cached = self._verdicts.get(uid)
            verdict = (
                cached[1]
                if cached is not None and cached[0] == version and version
                else judge_pod(pod, recognise)
            )
            verdicts[uid] = (version, verdict)
            engine = verdict.engine
            if engine is not None and (engine.ready or uid in self._targets):
                replicas.append(replica_config(engine))
                engines.append(engine)
                ready[engine.replica] = engine.ready
                targets.add(uid)
            elif verdict.problems:
                problems[pod_key(pod)] = verdict.problems
        self._verdicts = verdicts
        self._targets = targets
        self._log_readiness(ready)
        self._ready = ready
        self.state.terminal_pods = frozenset(
            pod_key(pod)
            for pod in pods.values()
            if isinstance(pod.get("status"), Mapping) and pod["status"].get("phase") in TERMINAL_PHASES
        )
        self._log_problems(problems)
        self._problems = problems
        replicas.sort(key=lambda r: r.name)
        if tuple(replicas) != self._replicas:
            self._log_changes(tuple(replicas))
            self._replicas = tuple(replicas)
            self._set_replicas(self._replicas)
        self._bind_plugins(engines)
        self._publish()

    def _bind_plugins(self, engines: list[PodEngine]) -> None:
        directory = self.config.discovery.kubernetes.vllm_plugin_dir
        if directory is None or self._set_plugin_sockets is None:
            return
        found = plugin_sockets(directory, ((e.replica, e.uid) for e in engines))
        sockets = tuple(VllmPluginSocketConfig(replica, path) for replica, path in found)
        if sockets != self._plugin_sockets:
            for entry in (s for s in sockets if s not in self._plugin_sockets):
                log.info("replica %s: vLLM plugin socket %s", entry.replica, entry.path)
            self._plugin_sockets = sockets
            self._set_plugin_sockets(sockets)

    def _publish(self) -> None:
        self.state.discovery = DiscoveryStatus(
            self._stale, tuple(r.name for r in self._replicas), dict(self._problems), dict(self._ready)
        )

    def _log_readiness(self, ready: dict[str, bool]) -> None:
        for name, now in sorted(ready.items()):
            before = self._ready.get(name)
            if before is True and not now:
                log.warning("replica %s: pod not ready (readiness probe failing); still scraped", name)
            elif before is False and now:
                log.info("replica %s: pod ready again", name)

    def _log_problems(self, problems: dict[tuple[str, str], tuple[tuple[str, str], ...]]) -> None:
        for key, issues in problems.items():
            if self._problems.get(key) != issues:
                detail = "; ".join(f"{annotation}: {reason}" for annotation, reason in issues)
                log.warning("pod %s/%s: %s; not scraped until fixed", *key, detail)
        for key in self._problems.keys() - problems.keys():
            log.info("pod %s/%s: annotations fixed (or pod gone)", *key)

    def _log_changes(self, replicas: tuple[ReplicaConfig, ...]) -> None:
        before = {r.name: r for r in self._replicas}
        after = {r.name: r for r in replicas}
        for name in sorted(after.keys() - before.keys()):
            log.info("replica %s discovered: %s (%s)", name, after[name].metrics_url, after[name].backend)
        for name in sorted(before.keys() - after.keys()):
            log.info("replica %s gone (pod deleted, stopped or moved)", name)
        for name in sorted(after.keys() & before.keys()):
            if after[name] != before[name]:
                log.info("replica %s now at %s", name, after[name].metrics_url)
