"""``kvwatch`` command line: one module per subcommand in ``kvwatch/commands/``.

Each command module defines ``HELP`` (one line), ``DESCRIPTION`` (what it does, for ``--help``),
``add_arguments(parser)`` and ``main(args) -> int``. Heavy imports stay inside ``main``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from kvwatch import __version__

COMMANDS = (
    "run",
    "demo",
    "inspect",
    "check-config",
    "rules",
    "dashboards",
    "manifests",
    "docs",
    "report",
    "plan",
    "top",
)


def _module_name(command: str) -> str:
    return "kvwatch.commands." + command.replace("-", "_")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvwatch",
        description="KV-cache and per-output-length-band latency monitoring for LLM inference nodes.",
    )
    parser.add_argument("--version", action="version", version=f"kvwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        try:
            module = importlib.import_module(_module_name(command))
        except ModuleNotFoundError as exc:
            if exc.name == _module_name(command):
                continue  # command not built yet
            raise
        p = sub.add_parser(
            command,
            help=module.HELP,
            description=getattr(module, "DESCRIPTION", module.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
