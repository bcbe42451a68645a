"""``kvwatch dashboards``: Grafana dashboards as code."""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "generate the Grafana dashboards (Node, Latency by length band, Fleet)"
DESCRIPTION = """\
Generate kvwatch's Grafana dashboards (docs/dashboards.md):

  kvwatch-node.json             per replica KV cache, preemption and recompute, KV tier traffic
                                beside PCIe, GPU memory, NVLink, throttling, XIDs; kvwatch health
  kvwatch-latency-by-band.json  TTFT / TPOT / e2e p50 p90 p99 per output-length band, SLO
                                attainment, burn rates, error budget, outcomes, output lengths
  kvwatch-fleet.json            across nodes: stranded KV, replicas under the most pressure,
                                error budget per band, nodes

Every query is checked against kvwatch's metric catalog, its recording rules and a short list of
external metrics (up, ALERTS, dcgm-exporter's DCGM_FI_*) before anything is written. With --check
nothing is written: the committed files are compared with what would be generated, differences
are printed as a diff and the exit status is 1.

With --native, the Latency by length band dashboard reads native histograms (histogram_quantile
without le, histogram_fraction, histogram_count / histogram_sum) for a Prometheus that keeps native
histograms instead of classic buckets: dashboards/native/kvwatch-latency-by-band-native.json by
default, its own uid, beside the classic one (Node and Fleet read no histograms: they serve both).

Exit status: 0 written / up to date, 1 out of date, 2 a query reads an unknown series."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvwatch.mixin.dashboards.scaffold import DCGM_DASHBOARD_UID, DEFAULT_JOB

    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory for the dashboard JSON (default: dashboards, with --native dashboards/native)",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="read native histograms instead of classic buckets (docs/dashboards.md)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail with a diff when the files in --out are out of date",
    )
    parser.add_argument(
        "--dcgm-dashboard-uid",
        default=DCGM_DASHBOARD_UID,
        metavar="UID",
        help="uid of the dcgm-exporter dashboard the GPU links open (default: %(default)s, "
        "grafana.com dashboard 12239)",
    )
    parser.add_argument(
        "--job",
        default=DEFAULT_JOB,
        help="default of the Job variable: the kvwatch targets' job label (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    from kvwatch.mixin.dashboards import boards, render_dashboards
    from kvwatch.mixin.dashboards.check import name_problems
    from kvwatch.mixin.dashboards.scaffold import DCGM_DASHBOARD_UID, DEFAULT_JOB, Options
    from kvwatch.mixin.output import command_line, refused, write_or_check

    opts = Options(dcgm_dashboard_uid=args.dcgm_dashboard_uid, job=args.job, native=args.native)
    if refused("dashboards", name_problems(boards(opts), native=args.native)):
        return 2
    out = args.out or ("dashboards/native" if args.native else "dashboards")
    native = " --native" if args.native else ""
    regenerate = command_line(
        f"kvwatch dashboards{native} --out {out}",
        [
            ("--dcgm-dashboard-uid", args.dcgm_dashboard_uid, DCGM_DASHBOARD_UID),
            ("--job", args.job, DEFAULT_JOB),
        ],
    )
    return write_or_check(Path(out), render_dashboards(opts), args.check, regenerate)
