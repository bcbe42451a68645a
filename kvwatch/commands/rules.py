"""``kvwatch rules``: Prometheus rule files from an SLO file."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HELP = "generate Prometheus recording rules and alerts (per-band SLOs, KV, GPU, self)"
DESCRIPTION = """\
Generate kvwatch's Prometheus rule files from an SLO file (format: docs/alerting.md):

  kvwatch-node.rules.yaml   node level: recordings per replica and GPU (tier traffic vs PCIe,
                            recompute waste); KV, tier, GPU and kvwatch-health alerts
  kvwatch-fleet.rules.yaml  fleet level: outcome ratios per band, stranded KV capacity; the
                            stranded-capacity and long-request starvation alerts
  kvwatch-slo.rules.yaml    fleet level: per-band SLO error ratios, error budget, burn-rate alerts

Load the node file in every Prometheus that scrapes kvwatch, the fleet and SLO files where every
node's series are (the same Prometheus, or a global one / Thanos Ruler / Mimir ruler: docs/scale.md).
Files of earlier versions (kvwatch-recording, kvwatch-operational) are removed.

With --native the latency SLIs and the per-request preemption alert read native histograms
(histogram_count, histogram_sum, histogram_fraction) instead of the classic _bucket/_count/_sum
series, for a Prometheus that scrapes kvwatch's protobuf exposition with native histograms on and
keeps no classic buckets (docs/alerting.md); the files go to alerts/native by default. Thresholds
that are no boundary of the native schema (every default one but 2 s) are interpolated.

Every alert carries a runbook_url to <runbook base>/<AlertName>.md. With --check nothing is
written: the committed files are compared with what would be generated, differences are printed
as a diff and the exit status is 1 (for CI and pre-commit).

Exit status: 0 written / up to date, 1 out of date, 2 invalid SLO file or metric names."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvwatch.mixin.alerts import DEFAULT_JOB
    from kvwatch.mixin.rulefile import DEFAULT_RUNBOOK_BASE

    parser.add_argument(
        "--slo", default="alerts/slo.yaml", metavar="FILE", help="SLO file (default: %(default)s)"
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="directory for the rule files (default: alerts, with --native alerts/native)",
    )
    parser.add_argument(
        "--native",
        action="store_true",
        help="read native histograms instead of classic buckets (docs/alerting.md)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; fail with a diff when the files in --out are out of date",
    )
    parser.add_argument(
        "--runbook-base",
        default=DEFAULT_RUNBOOK_BASE,
        metavar="URL",
        help="base of every alert's runbook_url (default: %(default)s)",
    )
    parser.add_argument(
        "--job",
        default=DEFAULT_JOB,
        help="Prometheus job label of the kvwatch targets (default: %(default)s)",
    )


def main(args: argparse.Namespace) -> int:
    from kvwatch.config import ConfigError
    from kvwatch.mixin.alerts import DEFAULT_JOB
    from kvwatch.mixin.output import command_line, refused, write_or_check
    from kvwatch.mixin.promql import CLASSIC, NATIVE
    from kvwatch.mixin.rulefile import DEFAULT_RUNBOOK_BASE, name_problems
    from kvwatch.mixin.rules import RETIRED_FILES, render_rule_files, rule_files
    from kvwatch.mixin.slo import load_slo_file

    try:
        slo = load_slo_file(args.slo)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    out = args.out or ("alerts/native" if args.native else "alerts")
    source = os.path.relpath(Path(args.slo).resolve(), Path(out).resolve())
    files = rule_files(slo, source=source, job=args.job, form=NATIVE if args.native else CLASSIC)
    if refused("rules", name_problems(files, native=args.native)):
        return 2
    native = " --native" if args.native else ""
    regenerate = command_line(
        f"kvwatch rules{native} --slo {args.slo} --out {out}",
        [("--runbook-base", args.runbook_base, DEFAULT_RUNBOOK_BASE), ("--job", args.job, DEFAULT_JOB)],
    )
    return write_or_check(
        Path(out), render_rule_files(files, args.runbook_base), args.check, regenerate, retired=RETIRED_FILES
    )
