"""``kvwatch run --config FILE``: the node daemon."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: `kvwatch --help` stays fast
    from kvwatch.config import Config

HELP = "run the node agent: scrape engines, poll NVML, serve /metrics (and optional proxies)"
DESCRIPTION = """\
Run the kvwatch node agent (Kubernetes DaemonSet, sidecar or systemd service).

It scrapes every configured engine replica's /metrics on its own schedule, polls NVML, optionally
runs one streaming proxy per replica (proxy_listen), an OTLP/HTTP receiver for vLLM's request spans
and followers for SGLang request files, and serves one normalized Prometheus exposition on
--listen at /metrics, with a live status page at / and health endpoints /-/healthy and /-/ready.

With discovery.kubernetes enabled it also lists and watches the engine pods of its node
(KVWATCH_NODE) and scrapes each ready one as replica namespace/pod (docs/deploy.md).

SIGHUP, or a change to the config file (a ConfigMap update included), reloads the config: a valid
one applies its replicas, the engine interval and scrape settings at once (the log names a change
that needs a restart); an invalid one is refused with
every problem logged and the running config kept (kvwatch_config_last_reload_successful 0). A
SIGHUP during start-up is held and applied once the agent runs.

SIGTERM or Ctrl-C stops it cleanly: proxies close upstream requests (engines free their KV), the
ledger is flushed. Validate a config first with `kvwatch check-config FILE`."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        help="YAML config (default: environment KVWATCH_CONFIG, else no replicas)",
    )
    parser.add_argument("--listen", metavar="HOST:PORT", help="override the config's listen address")
    parser.add_argument(
        "--log-level", choices=("debug", "info", "warning", "error"), help="override the config's log_level"
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for noisy in ("httpx", "httpcore", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # "skipped: maximum number of running instances": a scrape still running at its next turn is
    # expected with a slow engine (its duration is exported); failures are logged by kvwatch itself
    logging.getLogger("apscheduler").setLevel(logging.ERROR)


def use_uvloop() -> None:
    """uvloop roughly halves the proxy's CPU per chunk (docs/performance.md); optional."""
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


#: the soft limit kvwatch asks for when the hard limit is unlimited
OPEN_FILES_WANTED = 1 << 20


def raise_open_files_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit, as nginx's worker_rlimit_nofile does; (soft, hard).

    Every proxied stream holds two descriptors (client and engine) and pooled engine connections hold
    more: a default soft limit of 1024 (or 256) silently drops clients and health checks. Under the
    systemd unit the limit comes from LimitNOFILE (its system-call filter denies setrlimit).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logging.getLogger("kvwatch").warning(
                "could not raise the open-files limit from %d to %d (%s); the proxy's connections are "
                "bounded by it",
                soft,
                wanted,
                exc,
            )
    return soft, hard


def hold_hangups() -> list[int]:
    """From now on SIGHUP is noted, not fatal (its default action ends the process): a reload asked
    for while the agent starts (imports, NVML, binding its sockets) is done once it runs."""
    held: list[int] = []
    signal.signal(signal.SIGHUP, lambda signum, frame: held.append(signum))
    return held


def main(args: argparse.Namespace) -> int:
    hangups = hold_hangups()  # first: everything below can take seconds
    import dataclasses
    import os

    from kvwatch.agent.reload import fingerprint
    from kvwatch.config import ConfigError, load_config, parse_host_port

    path = args.config or os.environ.get("KVWATCH_CONFIG") or None  # blank is unset, as KVWATCH_* are
    loaded = fingerprint(path) if path is not None else None  # before reading: an edit from now on shows

    def adjust(config: Config) -> Config:
        """The command line over the file, at start and at every reload."""
        if args.listen:
            config = dataclasses.replace(config, listen=parse_host_port(args.listen))
        if args.log_level:
            config = dataclasses.replace(config, log_level=args.log_level)
        return config

    try:
        config = adjust(load_config(path))
    except (ConfigError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 1
    configure_logging(config.log_level)
    soft, _ = raise_open_files_limit()
    logging.getLogger("kvwatch").info("open files limit: %d", soft)
    use_uvloop()
    return asyncio.run(_serve(config, path, adjust, hangups, loaded))


async def _serve(
    config: Config,
    path: str | None = None,
    adjust: Callable[[Config], Config] = lambda c: c,
    hangups: list[int] | None = None,
    loaded: tuple[str, bytes] | None = None,
) -> int:
    from kvwatch.agent import Agent
    from kvwatch.agent.heap import freeze_start_up_heap
    from kvwatch.agent.reload import ConfigReloader
    from kvwatch.status.page import make_status_routes

    log = logging.getLogger("kvwatch")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    agent = Agent(config, route_factories=[make_status_routes])
    reloader = None
    if path is not None:
        reloader = ConfigReloader(
            path,
            lambda: agent.file_config,
            agent.apply_config,
            agent.state.config_reload,
            adjust,
            seen=loaded,
        )
        reloader.loaded()
    try:
        await agent.start()
    except OSError as exc:
        log.error("cannot start: %s", exc)
        await agent.stop()
        return 1
    freeze_start_up_heap()
    if reloader is not None:
        loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        if hangups:
            reloader.reload("SIGHUP during start-up")
        reloader.start()
    else:
        loop.add_signal_handler(signal.SIGHUP, log.warning, "SIGHUP: no config file to reload (--config)")
    log.info("kvwatch running: %d replica(s) on node %s", len(config.replicas), config.node)
    await stop.wait()
    log.info("stopping")
    if reloader is not None:
        await reloader.stop()
    await agent.stop()
    return 0
