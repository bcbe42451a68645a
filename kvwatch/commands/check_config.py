"""``kvwatch check-config FILE``."""

from __future__ import annotations

import argparse
import sys

HELP = "validate a config file; every problem is named by its key path"
DESCRIPTION = """\
Validate a kvwatch YAML config file (with KVWATCH_* environment overrides applied) without
starting anything. Every problem is printed with its key path and the reason, e.g.

  replicas[1].metrics_url: expected an http(s) URL, got 'localhost:8000'

Exit status 0 when the config is valid, 1 otherwise."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="YAML config file")
    parser.add_argument("--quiet", action="store_true", help="print nothing when the file is valid")


def main(args: argparse.Namespace) -> int:
    from kvwatch.config import ConfigError, load_config

    try:
        cfg = load_config(args.file)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    if not args.quiet:
        names = ", ".join(r.name for r in cfg.replicas) or "none"
        found = []
        if cfg.discovery.kubernetes.enabled:
            api = cfg.discovery.kubernetes.api_url or "the in-cluster API"
            found.append(f"pods on node {cfg.node} through {api}")
        if cfg.discovery.pod_resources.enabled:
            found.append(f"GPU owners from {cfg.discovery.pod_resources.socket}")
        discovery = f"; discovery: {', '.join(found)}" if found else ""
        print(
            f"{args.file}: OK ({len(cfg.replicas)} replica(s): {names}; listen {cfg.listen}; "
            f"bands {', '.join(cfg.length_bands.names)}{discovery})"
        )
    return 0
