"""``kvwatch manifests``: Kubernetes PrometheusRule and dashboard ConfigMaps from alerts/ and dashboards/."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

HELP = "write the Kubernetes PrometheusRule and Grafana dashboard ConfigMaps (--check: fail if stale)"
DESCRIPTION = """\
Generate deploy/kubernetes/monitoring/prometheusrule.yaml (one PrometheusRule per rule file in
alerts/, promtool test files skipped) and grafana-dashboards.yaml (one ConfigMap per dashboard in
dashboards/, labelled grafana_dashboard="1" for the Grafana sidecar). Run from the repository root.

With --check nothing is written: the command prints what differs and exits 1 when the files are not
what the sources generate (CI runs this), 0 when they are up to date."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--alerts", default="alerts", help="rule files directory (default: %(default)s)")
    parser.add_argument(
        "--dashboards", default="dashboards", help="dashboards directory (default: %(default)s)"
    )
    parser.add_argument(
        "--out", default="deploy/kubernetes/monitoring", help="where the manifests go (default: %(default)s)"
    )
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files are stale")


def main(args: argparse.Namespace) -> int:
    from kvwatch.mixin.k8s import ManifestError, generate

    out = Path(args.out)
    for flag, where in (("--alerts", args.alerts), ("--dashboards", args.dashboards)):
        if not Path(where).is_dir():  # a typo would otherwise ship a PrometheusRule with no rules
            print(
                f"kvwatch manifests: {flag} {where}: no such directory (run from the repository root, "
                f"or pass {flag})",
                file=sys.stderr,
            )
            return 1
    try:
        if not args.check:
            out.mkdir(parents=True, exist_ok=True)
        files = generate(Path(args.alerts), Path(args.dashboards))
    except (ManifestError, OSError) as exc:
        print(f"kvwatch manifests: {exc}", file=sys.stderr)
        return 1
    stale = []
    for name, text in files.items():
        path = out / name
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if args.check:
            diff = difflib.unified_diff(
                (current or "").splitlines(keepends=True),
                text.splitlines(keepends=True),
                fromfile=f"{path} (in tree)",
                tofile=f"{path} (generated)",
                n=1,
            )
            sys.stdout.writelines(list(diff)[:40])
        else:
            try:
                path.write_text(text, encoding="utf-8")
            except OSError as exc:
                print(f"kvwatch manifests: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
                return 1
            print(f"wrote {path}")
    if args.check and stale:
        print(f"\n{len(stale)} file(s) out of date: run `kvwatch manifests`", file=sys.stderr)
        return 1
    if not stale:
        print(f"{out}: up to date")
    return 0
