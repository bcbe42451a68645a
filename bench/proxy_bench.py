"""Streaming-proxy benchmark: direct vs nginx vs kvwatch (and bare relays), in one run.

Every target relays the same local SSE upstream to the same client. The upstream, the client and
the proxy under test run in separate processes, so the proxy's CPU (``/proc/<pid>/stat`` utime +
stime, children included: nginx's worker) is its own. Each content chunk carries the upstream's
``perf_counter_ns`` send time (CLOCK_MONOTONIC, shared by all processes on the host) as its text, so
the client measures per-chunk latency end to end; the "added" figures subtract the direct run's.

TTFT here is the path's share of it: the client's TTFT minus the upstream's own (request received
-> first content chunk written, both stamped into the stream), so the upstream's timer jitter does not
count; "added" subtracts the direct connection's value.

Phases per target:
  steady  64 streams in flight (``--chunks``, 200 by default, 10 ms apart, like an engine); new requests
          arrive one by one as streams finish: TTFT of those arrivals, latency of every chunk, proxy CPU.
  burst   64 requests at once (3 rounds): TTFT p99.
  flat    64 streams of as many chunks as fast as the upstream can write: chunks per CPU-second.

Scenario ``late-tail`` (``--scenario late-tail``): the upstream writes ``[DONE]`` and then waits
0.5-2 s before its last-chunk marker (vLLM's frontend does so under load); its streams are 10-30
chunks long (``--stream-chunks``). 16 clients each send 6 requests one after the other on one
keep-alive connection, the next as soon as the previous response is complete (or, with ``--pace``,
no sooner than a drawn time after the previous was sent): TTFT of the requests on reused
connections, against direct and nginx, and how bunched each target's arrivals were. A client
through kvwatch does not wait for the tail, so it sends faster and, with streams all alike, in step
with the others: ``--pace`` longer than the longest response gives every target the same arrivals.

  .venv/bin/python bench/proxy_bench.py                       # direct, nginx, kvwatch (uvloop)
  .venv/bin/python bench/proxy_bench.py --targets direct,nginx,aiohttp,aiohttp-uvloop,raw,raw-uvloop
  .venv/bin/python bench/proxy_bench.py --targets direct,nginx,raw-uvloop,rawcount-uvloop,kvwatch-uvloop
  .venv/bin/python bench/proxy_bench.py --scenario late-tail
  .venv/bin/python bench/proxy_bench.py --scenario late-tail --requests 12 --pace 2.4,2.8
  .venv/bin/python bench/proxy_bench.py --targets direct,nginx,nginxlua,kvwatch-uvloop
  .venv/bin/python bench/proxy_bench.py --scenario late-tail --baseline /tmp/base \\
      --targets direct,nginx,kvwatch-uvloop,kvwatchbase-uvloop         # this checkout against another

Target ``nginxlua``: Debian's nginx with kvwatch's request accounting in Lua
(proxybench/nginx_meter.lua, libnginx-mod-http-lua and lua-cjson), reporting to a ``meter`` role
that applies its messages with the agent's own ChannelReceiver; the CPU of both counts. A prototype
of nginx as kvwatch's data plane, measured; before measuring, the bench checks its totals against
the clients' and exits 1 if they differ.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from _harness import parser
from proxybench.common import BASELINE_ENV, _use_uvloop, run_until_sigterm
from proxybench.peers import ROLES
from proxybench.scenarios import orchestrate, orchestrate_late_tail


def _run_role(args: argparse.Namespace) -> int:
    """A role process runs until SIGTERM; ``KVWATCH_BENCH_PROFILE=FILE`` dumps cProfile stats."""
    _use_uvloop(args.uvloop)
    profile_to = os.environ.get("KVWATCH_BENCH_PROFILE") if args.role != "upstream" else None
    profiler = None
    if profile_to:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()

    run_until_sigterm(lambda: ROLES[args.role](args))
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile_to}.{os.getpid()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--targets",
        default="direct,nginx,kvwatch-uvloop",
        help="comma list: direct, nginx, kvwatch[-uvloop], kvwatchbase[-uvloop], "
        "aiohttp[-uvloop], raw[-uvloop], rawcount[-uvloop] (the raw relay plus the least per-read "
        "accounting), nginxlua (nginx with kvwatch's accounting in Lua)",
    )
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--seconds", type=float, default=8.0, help="steady phase length per target")
    p.add_argument("--rounds", type=int, default=3, help="interleaved repetitions; medians are reported")
    p.add_argument("--json", help="also write the rows as JSON here")
    p.add_argument("--uvloop-client", action="store_true", default=True)
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--upstream-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--socket", help=argparse.SUPPRESS)  # role meter: where nginx_meter.lua sends
    p.add_argument(
        "--chunks",
        type=int,
        default=200,
        help="streaming: content chunks per stream, steady and flat (default 200); two runs at "
        "different lengths split CPU into per chunk and per request",
    )
    p.add_argument("--interval", type=float, default=0.01, help=argparse.SUPPRESS)
    p.add_argument("--tail", help=argparse.SUPPRESS)
    p.add_argument("--chunk-range", help=argparse.SUPPRESS)  # role upstream: LOW,HIGH chunks a stream
    p.add_argument(
        "--scenario",
        choices=("streaming", "late-tail"),
        default="streaming",
        help="streaming: steady, burst and flat phases; late-tail: [DONE] 0.5-2 s before the "
        "stream ends, clients reuse connections",
    )
    p.add_argument("--uvloop", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--baseline",
        help="a checkout (e.g. from git worktree or git archive) whose kvwatch the "
        "kvwatchbase[-uvloop] target runs",
    )
    p.add_argument("--clients", type=int, default=16, help="late-tail: keep-alive clients")
    p.add_argument("--requests", type=int, default=6, help="late-tail: sequential requests per client")
    p.add_argument(
        "--pace",
        metavar="LOW,HIGH",
        help="late-tail: a client's next request goes no sooner than this many seconds (drawn "
        "uniformly) after its previous one was sent; longer than the longest response (stream + "
        "tail), every target sees the same arrivals (default: as soon as the response is complete)",
    )
    p.add_argument(
        "--stream-chunks",
        default="10,30",
        metavar="LOW,HIGH",
        help="late-tail: content chunks per stream, drawn uniformly (default 10,30; 20,20 is every "
        "stream alike, which keeps clients that do not wait for the tail in step)",
    )
    args = p.parse_args(argv)
    if args.quick and not args.role:
        args.streams, args.seconds, args.rounds, args.clients, args.requests = 8, 1.0, 1, 4, 2
    if args.baseline:
        os.environ[BASELINE_ENV] = str(Path(args.baseline).resolve())
    if args.role:
        return _run_role(args)
    if args.scenario == "late-tail":
        return orchestrate_late_tail(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
