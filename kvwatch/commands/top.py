"""``kvwatch top``: a running agent's status page in the terminal."""

from __future__ import annotations

import argparse
import shutil
import sys
import time

from kvwatch.config import DEFAULT_LISTEN

HELP = "live KV-cache and length-band view of a running agent in the terminal"
MAX_WAIT_S = 3600.0  # --interval and --timeout: an hour is already longer than anyone watches
DESCRIPTION = f"""\
Show what the agent's status page shows (per replica KV occupancy, fragmentation, headroom,
running / waiting / preemptions, stranded capacity, per-band latency and outcomes, GPU memory and
PCIe), refreshed every --interval seconds, read from the agent's /status.json.

  kvwatch top                                  # agent on this host, port {DEFAULT_LISTEN.rsplit(":", 1)[1]}
  kvwatch top --url http://gpu-node-7:9477
  kvwatch top --once | less -S                 # one frame, no screen control (for pipes)

A row marked ! needs a look (replica down, KV full, GPU lost or PCIe link down-trained). Exit
status 1 when --once cannot reach the agent."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    port = DEFAULT_LISTEN.rsplit(":", 1)[1]
    parser.add_argument(
        "--url",
        default=f"http://127.0.0.1:{port}",
        help="agent base URL or its /status.json (default: %(default)s)",
    )
    parser.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default: %(default)s)"
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="cut lines to this many columns (default: the terminal's; none when piped)",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for the agent (default: %(default)s)"
    )


def _width(args: argparse.Namespace, tty: bool) -> int:
    if args.width is not None:
        return args.width
    return shutil.get_terminal_size().columns if tty else 0


def main(args: argparse.Namespace) -> int:
    from kvwatch.status.top import CLEAR, AgentUnreachableError, fetch_view, render_text, status_url

    try:
        url = status_url(args.url)
    except AgentUnreachableError as exc:
        print(f"kvwatch top: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    tty = out.isatty()
    for flag, seconds in (("--interval", args.interval), ("--timeout", args.timeout)):
        if not 0 < seconds <= MAX_WAIT_S:  # NaN too; inf overflows the socket timeout and sleep
            print(
                f"kvwatch top: {flag} must be a positive number of seconds, at most {MAX_WAIT_S:g}, "
                f"not {seconds:g}",
                file=sys.stderr,
            )
            return 2
    while True:
        try:
            frame = render_text(fetch_view(url, args.timeout), _width(args, tty))
        except AgentUnreachableError as exc:
            if args.once:
                print(f"kvwatch top: {exc}", file=sys.stderr)
                return 1
            frame = f"kvwatch top: {exc} (retrying every {args.interval:g}s)\n"
        if args.once:
            out.write(frame)
            return 0
        out.write((CLEAR if tty else "\n") + frame)
        out.flush()
        time.sleep(args.interval)
