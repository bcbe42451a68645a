"""``kvwatch demo``: the embedded default, a simulated 8x H200 node watched by the real agent."""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported lazily: `kvwatch --help` stays fast
    from kvwatch.config import HostPort
    from kvwatch.demo import DemoNode
    from kvwatch.status.view import StatusView

HELP = "run a simulated 8x H200 node (no GPU, no engine needed) watched by the real agent"
DESCRIPTION = """\
Start a simulated inference node and watch it with the real kvwatch agent, in one process:

  - N data-parallel engine replicas (a paged-KV, continuous-batching simulator that speaks vLLM's
    /metrics and the OpenAI streaming API; Qwen3-32B on H200 by default),
  - fake GPUs whose memory and PCIe traffic follow the simulated engines,
  - a reasoning workload (about 45% of outputs over 5,000 tokens) sent through kvwatch's proxies,
    with a router that pins half the long requests to replica-0,
  - the agent, serving /metrics, the status page (/) and /status.json on --listen.

Within a minute the story unfolds: replica-0's KV cache fills, it preempts and queues, long requests
slow down while short ones stay fast, and free KV on the other replicas sits stranded. Time runs
--speed times faster than the wall clock; latencies and headroom are in simulated seconds.

Ctrl-C or --duration ends it cleanly and prints a summary."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvwatch.sim.models import MODELS

    parser.add_argument(
        "--replicas",
        type=int,
        default=8,
        metavar="N",
        help="data-parallel replicas (default 8: one per H200)",
    )
    parser.add_argument(
        "--model", default="qwen3-32b", choices=sorted(MODELS), help="model preset (default qwen3-32b)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica (default 1)")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="stop after S wall seconds (default: run until Ctrl-C)",
    )
    parser.add_argument(
        "--listen",
        default="127.0.0.1:9477",
        metavar="HOST:PORT",
        help="where the agent serves /metrics and the status page (default 127.0.0.1:9477)",
    )
    parser.add_argument(
        "--speed",
        type=float,
        default=20.0,
        metavar="X",
        help="simulated seconds per wall second (default 20, at most 1000)",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="R",
        help="requests per simulated second for the whole node (default 1.0, at most 100)",
    )
    parser.add_argument(
        "--router",
        default="skewed",
        choices=("skewed", "least_loaded", "round_robin", "random"),
        help="how requests are spread (default skewed: strands capacity)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (same seed, same workload)")
    parser.add_argument("--ledger", metavar="PATH", help="also write the request ledger (JSONL) here")
    parser.add_argument(
        "--view",
        choices=("auto", "live", "lines", "none"),
        default="auto",
        help="live terminal view (auto: live on a terminal, a line every 10 s otherwise)",
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "--metrics-profile",
        default="lean",
        choices=("lean", "full"),
        help="the agent's metrics.profile (default lean; docs/scale.md)",
    )


#: simulated seconds a wall second, and requests a simulated second, the demo can keep up with (past
#: them the simulation falls behind the wall clock and never reaches --duration)
MAX_SPEED = 1000.0
MAX_RATE = 100.0


@dataclass
class StoryTracker:
    """Peaks seen while the demo ran, for the closing summary."""

    peak_usage: dict[str, float] = field(default_factory=dict)
    peak_waiting: dict[str, float] = field(default_factory=dict)
    peak_stranded: float = 0.0
    first_preemption_at: float | None = None

    def observe(self, view: StatusView, elapsed_s: float) -> None:
        for replica in view.replicas:
            for unit in replica.units:
                if unit.kv_usage_ratio is not None:
                    self.peak_usage[replica.name] = max(
                        self.peak_usage.get(replica.name, 0.0), unit.kv_usage_ratio
                    )
                if unit.requests_waiting is not None:
                    self.peak_waiting[replica.name] = max(
                        self.peak_waiting.get(replica.name, 0.0), unit.requests_waiting
                    )
                if self.first_preemption_at is None and (unit.preemptions_total or 0) > 0:
                    self.first_preemption_at = elapsed_s
        for stranded in view.stranded:
            self.peak_stranded = max(self.peak_stranded, stranded.stranded_tokens)


def main(args: argparse.Namespace) -> int:
    from kvwatch.commands.run import configure_logging, use_uvloop
    from kvwatch.config import parse_host_port

    problems = ["--replicas and --tp must be >= 1"] if args.replicas < 1 or args.tp < 1 else []
    for flag, value, most in (("--speed", args.speed, MAX_SPEED), ("--rate", args.rate, MAX_RATE)):
        if value is not None and not 0 < value <= most:  # NaN too: it ran away, ignoring --duration
            problems.append(f"{flag} must be a number > 0 and at most {most:g}, got {value:g}")
    if args.duration is not None and not 0 < args.duration < math.inf:
        problems.append(f"--duration must be a finite number of seconds > 0, got {args.duration:g}")
    if problems:
        print(f"kvwatch demo: {'; '.join(problems)}", file=sys.stderr)
        return 2
    try:
        listen = parse_host_port(args.listen)
    except ValueError as exc:
        print(f"kvwatch demo: --listen: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    use_uvloop()
    return asyncio.run(_demo(args, listen))


async def _demo(args: argparse.Namespace, listen: HostPort) -> int:
    from kvwatch.demo import DemoNode, DemoSettings
    from kvwatch.status.top import render_text
    from kvwatch.status.view import build_view

    settings = DemoSettings(
        replicas=args.replicas,
        model=args.model,
        tp=args.tp,
        speed=args.speed,
        listen=listen,
        rate=args.rate,
        router=args.router,
        seed=args.seed,
        ledger=args.ledger,
        metrics_profile=args.metrics_profile,
    )
    try:
        demo = DemoNode(settings)
    except ValueError as exc:  # a layout the engine refuses, e.g. --tp 3 for 8 KV heads
        print(f"kvwatch demo: {exc}", file=sys.stderr)
        return 2
    try:
        await demo.start()
    except OSError as exc:
        print(f"kvwatch demo: cannot start: {exc}", file=sys.stderr)
        await demo.stop()
        return 1
    agent = demo.agent
    assert agent is not None
    url = f"http://{listen.host}:{agent.port}"
    mode = args.view
    if mode == "auto":
        mode = "live" if sys.stdout.isatty() else "lines"
    print(
        f"kvwatch demo: {settings.replicas} x {settings.model} on simulated H200s at {settings.speed:g}x "
        f"speed; metrics {url}/metrics, status page {url}/",
        flush=True,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    story = StoryTracker()
    started = time.monotonic()

    async def watch() -> None:
        last_line = 0.0
        while True:
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - started
            view = build_view(agent.state, agent.config, agent.clock())
            story.observe(view, elapsed)
            header = _header(demo, elapsed, url)
            if mode == "live":
                width = shutil.get_terminal_size((120, 40)).columns
                sys.stdout.write("\x1b[H\x1b[2J" + header + "\n\n" + render_text(view, width))
                sys.stdout.flush()
            elif mode == "lines" and elapsed - last_line >= 10:
                last_line = elapsed
                print(header + " | " + _one_line(view), flush=True)

    watcher = asyncio.create_task(watch())
    try:
        await demo.run(args.duration, stop)
    finally:
        watcher.cancel()
        elapsed = time.monotonic() - started
        # the summary is what the run measured: read before the clients still waiting leave (their
        # disconnects are the demo's teardown)
        view = build_view(agent.state, agent.config, agent.clock())
        story.observe(view, elapsed)
        speed = demo.node.achieved_speed
        clients = _ClientTally.of(demo)
        await demo.stop()
    print()
    print(_summary(demo, view, story, clients, elapsed, speed))
    return 0


@dataclass(frozen=True, slots=True)
class _ClientTally:
    """What the demo's clients had seen when it stopped."""

    sent: int
    outcomes: dict[str, int]
    open_requests: int

    @classmethod
    def of(cls, demo: DemoNode) -> _ClientTally:
        loadgen = demo.loadgen
        if loadgen is None:
            return cls(0, {}, 0)
        report = loadgen.report
        return cls(report.sent, dict(report.outcomes), loadgen.open_requests)


def _header(demo: DemoNode, elapsed_s: float, url: str) -> str:
    sim_min = demo.node.sim_time / 60
    return (
        f"kvwatch demo  wall {elapsed_s:5.0f} s  simulated {sim_min:6.1f} min  "
        f"speed {demo.node.achieved_speed:4.1f}x  {url}/"
    )


def _one_line(view: StatusView) -> str:
    parts = []
    for replica in view.replicas:
        for unit in replica.units:
            usage = unit.kv_usage_ratio
            parts.append(
                f"{replica.name}:{'-' if usage is None else f'{usage:.0%}'}"
                f"/w{0 if unit.requests_waiting is None else int(unit.requests_waiting)}"
            )
    return " ".join(parts)


def _fmt_s(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.2f}s" if value < 100 else f"{value:.0f}s"


def _summary(
    demo: DemoNode,
    view: StatusView,
    story: StoryTracker,
    clients: _ClientTally,
    elapsed_s: float,
    speed: float,
) -> str:
    from kvwatch import texttable

    lines = [
        f"kvwatch demo summary: {elapsed_s:.0f} s wall = {demo.node.sim_time / 60:.1f} simulated minutes"
        f" ({speed:.1f}x), {clients.sent} requests sent"
    ]
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(clients.outcomes.items()))
    if outcomes:
        lines.append(f"  client outcomes: {outcomes}")
    if clients.open_requests:
        lines.append(
            f"  still in flight at the end: {clients.open_requests} (their clients left when the demo"
            " stopped; not in the table below)"
        )
    if story.peak_usage:
        usage = ", ".join(f"{name} {peak:.0%}" for name, peak in sorted(story.peak_usage.items()))
        lines.append(f"  peak KV usage: {usage}")
    total_preemptions = sum(u.preemptions_total or 0 for r in view.replicas for u in r.units)
    lines.append(
        f"  preemptions: {total_preemptions:.0f}"
        + (
            f" (first seen after {story.first_preemption_at:.0f} s)"
            if story.first_preemption_at is not None
            else ""
        )
    )
    if story.peak_waiting:
        worst = max(story.peak_waiting.items(), key=lambda kv: kv[1])
        lines.append(f"  longest queue: {worst[0]} with {worst[1]:.0f} waiting")
    lines.append(
        f"  peak stranded KV: {story.peak_stranded:,.0f} tokens free on idle replicas"
        " while another queued or preempted"
    )
    rows = [r for r in view.band_rows if r.replica == "(all)" and r.requests]
    if rows:
        headers = (
            "band",
            "requests",
            "completed",
            "truncated",
            "aborted",
            "TTFT p50",
            "TTFT p99",
            "TPOT p50",
            "TPOT p99",
        )
        table = []
        for r in rows:
            table.append(
                (
                    r.band,
                    str(r.requests),
                    _pct(r.completed_ratio),
                    _pct(r.truncated_ratio),
                    _pct(r.aborted_ratio),
                    _fmt_s(r.ttft_p50_seconds),
                    _fmt_s(r.ttft_p99_seconds),
                    _fmt_s(r.tpot_p50_seconds),
                    _fmt_s(r.tpot_p99_seconds),
                )
            )
        lines.append("  latency by output-length band (simulated seconds, measured by kvwatch's proxy):")
        lines.extend("    " + line for line in texttable.render(headers, table).splitlines())
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"
