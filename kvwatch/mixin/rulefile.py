"""Prometheus rule files as data: recording rules, alerts, groups, and their YAML rendering.

Alerts follow the monitoring-mixins style guide: CamelCase ``KVWatch…`` names, a ``severity`` of
``critical`` (pages), ``warning`` (a ticket) or ``info``, a static ``summary``, a templated
``description`` and a ``runbook_url`` to ``docs/runbooks/<AlertName>.md`` under a configurable base.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import yaml

from kvwatch.mixin.promql import unknown_names

CRITICAL = "critical"  # pages someone now
WARNING = "warning"  # a ticket: look during working hours
INFO = "info"
SEVERITIES = (CRITICAL, WARNING, INFO)

DEFAULT_RUNBOOK_BASE = "https://github.com/kvwatch/kvwatch/blob/main/docs/runbooks/"


@dataclass(frozen=True, slots=True)
class Recording:
    record: str
    expr: str
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Alert:
    alert: str
    expr: str
    severity: str
    summary: str
    description: str
    for_: str | None = None
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"{self.alert}: severity must be one of {SEVERITIES}, got {self.severity!r}")


Rule = Recording | Alert


@dataclass(frozen=True, slots=True)
class Group:
    name: str
    rules: tuple[Rule, ...]
    interval: str | None = None


@dataclass(frozen=True, slots=True)
class RuleFile:
    filename: str  # relative to the output directory, e.g. "kvwatch-slo.rules.yaml"
    header: str  # comment lines at the top: what the file is and how it is regenerated
    groups: tuple[Group, ...] = field(default_factory=tuple)

    def rules(self) -> Iterator[Rule]:
        for group in self.groups:
            yield from group.rules


def runbook_url(base: str, alert: str) -> str:
    return f"{base.rstrip('/')}/{alert}.md"


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (expressions) as literal blocks; lists indented under their key."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _rule_dict(rule: Rule, runbook_base: str) -> dict[str, object]:
    if isinstance(rule, Recording):
        out: dict[str, object] = {"record": rule.record, "expr": rule.expr}
        if rule.labels:
            out["labels"] = dict(rule.labels)
        return out
    out = {"alert": rule.alert, "expr": rule.expr}
    if rule.for_:
        out["for"] = rule.for_
    out["labels"] = {"severity": rule.severity, **dict(rule.labels)}
    out["annotations"] = {
        "summary": rule.summary,
        "description": rule.description,
        "runbook_url": runbook_url(runbook_base, rule.alert),
    }
    return out


def render(rule_file: RuleFile, runbook_base: str = DEFAULT_RUNBOOK_BASE) -> str:
    """The rule file as Prometheus reads it, with a header comment; deterministic."""
    groups = []
    for group in rule_file.groups:
        g: dict[str, object] = {"name": group.name}
        if group.interval:
            g["interval"] = group.interval
        g["rules"] = [_rule_dict(r, runbook_base) for r in group.rules]
        groups.append(g)
    body = yaml.dump({"groups": groups}, Dumper=_Dumper, sort_keys=False, width=1000, allow_unicode=True)
    header = "".join(f"# {line}".rstrip() + "\n" for line in rule_file.header.strip().splitlines())
    return header + body


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------


def recorded_names(files: Iterable[RuleFile]) -> set[str]:
    return {r.record for f in files for r in f.rules() if isinstance(r, Recording)}


def alert_names(files: Iterable[RuleFile]) -> list[str]:
    """Every alert name once, in file order."""
    seen: dict[str, None] = {}
    for f in files:
        for r in f.rules():
            if isinstance(r, Alert):
                seen.setdefault(r.alert, None)
    return list(seen)


def name_problems(files: Iterable[RuleFile], native: bool = False) -> list[str]:
    """Every rule that reads a series kvwatch does not export, record or allow (with where); with
    ``native``, also every read of a classic series of a native histogram."""
    files = list(files)
    recorded = recorded_names(files)
    problems = []
    for f in files:
        for group in f.groups:
            for rule in group.rules:
                what = rule.record if isinstance(rule, Recording) else rule.alert
                where = f"{f.filename}: {group.name}: {what}"
                problems += [f"{where}: {p}" for p in unknown_names(rule.expr, recorded, native)]
    return problems
