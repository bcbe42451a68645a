"""``kvwatch docs [--check]``: docs/metrics.md from the metric catalog, docs/config.md from the schema."""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

HELP = "regenerate docs/metrics.md (metric catalog) and docs/config.md (config schema)"
DESCRIPTION = """\
Rewrite the generated part of docs/metrics.md (between its BEGIN/END GENERATED markers): one row per
metric family kvwatch exports (name on the wire, type, labels, meaning), and the bucket boundaries
of the request histograms (SLO thresholds must be one of them). Rewrite the generated part of
docs/config.md the same way: one row per config key (type, default, bounds, environment variable,
meaning), from the schema in kvwatch/config/schema.py. The prose around each is kept.

--check exits 1 and prints a diff when either file is stale (CI runs it)."""

BEGIN = "<!-- BEGIN GENERATED: kvwatch docs (do not edit by hand) -->"
END = "<!-- END GENERATED -->"
AREAS = (
    ("self", "kvwatch itself"),
    ("replica", "Engine replicas (normalized from each engine's /metrics)"),
    ("derived", "Derived KV signals"),
    ("gpu", "GPUs (NVML)"),
    ("request", "Requests by output-length band"),
    ("plugin", "Engine steps and KV blocks (kvwatch's vLLM plugin)"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--file", default="docs/metrics.md", help="the metric reference to update")
    parser.add_argument("--config-file", default="docs/config.md", help="the config reference to update")
    parser.add_argument("--check", action="store_true", help="fail (exit 1) if a file is stale")


def reference() -> str:
    from kvwatch import buckets
    from kvwatch.catalog import CATALOG
    from kvwatch.state import HISTOGRAM_FAMILIES

    lines: list[str] = []
    for area, title in AREAS:
        lines += [f"### {title}", "", "| metric | type | labels | meaning |", "|---|---|---|---|"]
        for spec in (s for s in CATALOG if s.area == area):
            shown = ", ".join(f"`{n}`" for n in spec.series_names)
            labels = ", ".join(spec.labels) or "-"
            lines.append(f"| {shown} | {spec.kind} | {labels} | {spec.help} |")
        lines.append("")
    lines += [
        "### Request histogram buckets (upper bounds; `+Inf` implied)",
        "",
        "| histogram | bucket boundaries |",
        "|---|---|",
    ]
    layouts = (
        *HISTOGRAM_FAMILIES.items(),
        ("kvwatch_request_output_tokens", buckets.OUTPUT_TOKENS),
        ("kvwatch_engine_step_seconds", buckets.STEP_SECONDS),
        ("kvwatch_kv_block_lifetime_seconds (idle, reuse gap)", buckets.KV_BLOCK_SECONDS),
    )
    for name, bounds in layouts:
        lines.append(f"| `{name}` | {', '.join(f'{b:g}' for b in bounds)} |")
    lines += [
        "",
        "`kvwatch_request_output_tokens` also gets every configured length-band edge as a boundary.",
        "",
        "`kvwatch_engine_step_seconds` is labelled `batch_tokens` by the step's scheduled tokens "
        "(context + generation): " + ", ".join(f"`{n}`" for n in _batch_bands()) + ".",
    ]
    return "\n".join(lines)


def _batch_bands() -> tuple[str, ...]:
    from kvwatch.state.plugin import BATCH_TOKEN_BANDS

    return BATCH_TOKEN_BANDS.names


def render(current: str, generated: str) -> str:
    """``current`` with its generated region replaced by ``generated`` (appended without markers)."""
    generated = f"{BEGIN}\n\n{generated}\n\n{END}"
    if BEGIN in current and END in current:
        head, _, rest = current.partition(BEGIN)
        _, _, tail = rest.partition(END)
        return head + generated + tail
    return current.rstrip("\n") + "\n\n## Reference\n\n" + generated + "\n"


def main(args: argparse.Namespace) -> int:
    from kvwatch.config import reference as config_reference

    stale = [
        _update(Path(args.file), "# kvwatch metrics\n", reference(), args.check),
        _update(
            Path(args.config_file), "# kvwatch configuration\n", config_reference.reference(), args.check
        ),
    ]
    return 1 if any(stale) else 0


def _update(path: Path, empty: str, generated: str, check: bool) -> bool:
    """Write (or with ``check``, compare) ``path``'s generated region; True when it was stale."""
    current = path.read_text(encoding="utf-8") if path.exists() else empty
    wanted = render(current, generated)
    if wanted == current:
        return False
    if check:
        sys.stdout.writelines(
            difflib.unified_diff(current.splitlines(True), wanted.splitlines(True), str(path), "generated")
        )
        print(f"{path} is stale: run `kvwatch docs`", file=sys.stderr)
        return True
    try:
        path.write_text(wanted, encoding="utf-8")
    except OSError as exc:
        print(f"kvwatch docs: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
        return True
    print(f"wrote {path}")
    return False
