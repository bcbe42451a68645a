"""Config reload without a restart: on SIGHUP, or when the config file's content changes.

A ConfigMap mounted as a volume is a symlink chain the kubelet swaps atomically on update
(``kvwatch.yaml -> ..data/kvwatch.yaml``, ``..data -> ..2026_12_01_18_00_00.123``; the new
timestamped directory is written, then ``..data`` is renamed over). So the file is not written in
place and its mtime may not change: the watcher compares what the path resolves to and the bytes
it reads, every ``poll_s``. (The kubelet itself applies ConfigMap edits within about a minute; a
``subPath`` mount never updates, so the manifests mount the directory.)

The new file is validated first, with the same loader and environment overrides as at start. A
bad edit keeps the running config, logs every problem with its key path, and sets
``kvwatch_config_last_reload_successful 0`` (Prometheus's name for the same thing). Replicas,
the engine interval, scrape settings, the vLLM plugin sockets and the log level apply at once;
settings that bind sockets or start sources (listen, proxies and a proxied replica's model_name,
OTLP, NVML and the GPU and process-map intervals, ledger, discovery, bands, node) need a restart: a
changed one is logged and keeps its running value.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from kvwatch.config import Config, ConfigError, load_config
from kvwatch.state import ConfigReloadStatus

log = logging.getLogger(__name__)

#: top-level settings a running agent cannot change (they bind sockets or start sources)
RESTART_ONLY = (
    "listen",
    "node",
    "length_bands",
    "nvml",
    "proxy",
    "otlp",
    "sglang_request_files",
    "ledger",
    "discovery",
    "metrics",
)


#: intervals of jobs scheduled once, at start (the engine scrape's is rescheduled on reload)
RESTART_ONLY_INTERVALS = ("gpu_s", "process_map_s")


def restart_only_changes(running: Config, new: Config) -> list[str]:
    """Keys whose new value needs a restart to take effect."""
    changed = [key for key in RESTART_ONLY if getattr(running, key) != getattr(new, key)]
    changed += [
        f"intervals.{key.removesuffix('_s')}"
        for key in RESTART_ONLY_INTERVALS
        if getattr(running.intervals, key) != getattr(new.intervals, key)
    ]
    proxied = {(r.name, r.proxy_listen, r.api_url) for r in running.replicas if r.proxy_listen}
    if proxied != {(r.name, r.proxy_listen, r.api_url) for r in new.replicas if r.proxy_listen}:
        changed.append("replicas[].proxy_listen")
    labels = {r.name: r.model_name for r in new.replicas if r.proxy_listen}
    if any(labels.get(r.name, r.model_name) != r.model_name for r in running.replicas if r.proxy_listen):
        changed.append("replicas[].model_name of a proxied replica")  # its proxy labels with the first
    return changed


def applicable(running: Config, new: Config) -> Config:
    """The new config with every restart-only setting kept at its running value."""
    kept = {key: getattr(running, key) for key in RESTART_ONLY}
    by_name = {r.name: r for r in running.replicas}
    replicas = tuple(
        dataclasses.replace(
            r,
            proxy_listen=by_name[r.name].proxy_listen,
            api_url=by_name[r.name].api_url,
            model_name=by_name[r.name].model_name if by_name[r.name].proxy_listen else r.model_name,
        )
        if r.name in by_name
        else dataclasses.replace(r, proxy_listen=None)
        for r in new.replicas
    )
    intervals = dataclasses.replace(
        new.intervals, **{key: getattr(running.intervals, key) for key in RESTART_ONLY_INTERVALS}
    )
    return dataclasses.replace(new, replicas=replicas, intervals=intervals, **kept)


def fingerprint(path: str) -> tuple[str, bytes] | None:
    """(where the path resolves to, a digest of its bytes); None while it cannot be read."""
    try:
        return os.path.realpath(path), hashlib.sha256(Path(path).read_bytes()).digest()
    except OSError:
        return None


@dataclasses.dataclass(eq=False)
class ConfigReloader:
    """Re-reads ``path`` and hands a valid result to ``apply``; records the outcome in ``status``.

    ``running()`` is the agent's running config (its file part), ``adjust`` the command-line
    overrides applied to every load (``--listen``), ``status`` the ``NodeState.config_reload``,
    ``seen`` the fingerprint of the file the running config came from.
    """

    path: str
    running: Callable[[], Config]
    apply: Callable[[Config], None]
    status: ConfigReloadStatus
    adjust: Callable[[Config], Config] = lambda c: c
    poll_s: float = 2.0
    clock: Callable[[], float] = time.time
    #: what the running config was read from (given: taken before it was read, so an edit made while
    #: the agent started is still a change; None: read now)
    seen: tuple[str, bytes] | None = None
    _task: asyncio.Task[None] | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.seen is None:
            self.seen = fingerprint(self.path)

    def loaded(self) -> None:
        """The config the agent started with loaded fine."""
        self.status.successful = True
        self.status.last_success_ts = self.clock()

    def reload(self, why: str) -> bool:
        self.seen = fingerprint(self.path)
        try:
            new = self.adjust(load_config(self.path))
        except (ConfigError, ValueError) as exc:
            self.status.successful = False
            self.status.last_error = str(exc)
            log.error("config reload (%s) refused, the running config is kept: %s", why, exc)
            return False
        running = self.running()
        for key in restart_only_changes(running, new):
            log.warning("config reload (%s): %s changed; it takes effect at the next restart", why, key)
        logging.getLogger("kvwatch").setLevel(new.log_level.upper())  # before apply: it hands it on
        self.apply(applicable(running, new))
        self.status.successful = True
        self.status.last_error = None
        self.status.last_success_ts = self.clock()
        log.info("config reloaded (%s): %d replica(s) in the file", why, len(new.replicas))
        return True

    async def watch(self) -> None:
        """Poll the file; reload when it (or what it resolves to) changes."""
        while True:
            await asyncio.sleep(self.poll_s)
            now = fingerprint(self.path)
            if now is not None and now != self.seen:
                self.reload(f"{self.path} changed, now {now[0]}")

    def start(self) -> None:
        self._task = asyncio.create_task(self.watch(), name="config-file-watch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
