"""Kubernetes manifests generated from the mixin: a PrometheusRule per rule file, a ConfigMap per dashboard.

The rule files in ``alerts/`` and the dashboards in ``dashboards/`` are the reviewed sources; the
manifests in ``deploy/kubernetes/monitoring/`` are derived from them so a cluster gets exactly what
``promtool`` and the dashboard tests checked. ``kvwatch manifests --check`` fails when they drift.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvwatch.config import safe_load
from kvwatch.jsonsafe import loads
from kvwatch.mixin.rules import LEVELS

RULES_FILE = "prometheusrule.yaml"
# Rule files are named ``*.rules.yaml`` (``kvwatch rules`` writes them); other YAML in alerts/ (the SLO
# spec, promtool tests) is not a rule file. Prometheus' rule_files glob in deploy/compose uses the same.
RULE_FILE_PATTERNS = ("*.rules.yaml", "*.rules.yml")
DASHBOARDS_FILE = "grafana-dashboards.yaml"
NAMESPACE = "kvwatch"
# A ConfigMap holds at most 1 MiB of data (etcd's object limit).
CONFIGMAP_MAX_BYTES = 1024 * 1024
# Keys the prometheus-operator PrometheusRule CRD (monitoring.coreos.com/v1) accepts; Prometheus rule
# files use the same keys. Anything else would be rejected by the API server or silently dropped.
GROUP_KEYS = frozenset(
    {"name", "interval", "rules", "limit", "query_offset", "labels", "partial_response_strategy"}
)
RULE_KEYS = frozenset({"alert", "record", "expr", "for", "keep_firing_for", "labels", "annotations"})
COMMON_LABELS = {"app.kubernetes.io/name": "kvwatch", "app.kubernetes.io/part-of": "kvwatch"}
# Where a PrometheusRule's rules evaluate (``node`` or ``fleet``, from ``kvwatch/mixin/rules.py``), so a
# ruleSelector picks whole files: node rules in every cluster Prometheus, fleet rules in the Prometheus or
# ThanosRuler that holds every node's series (docs/scale.md). Rule files kvwatch does not generate get none.
LEVEL_LABEL = "kvwatch.io/rule-level"
# Label the Grafana dashboard sidecar (kiwigrid/k8s-sidecar, as in the Grafana and kube-prometheus-stack
# Helm charts) looks for; the annotation names the folder when the sidecar's folderAnnotation is set to it.
DASHBOARD_LABEL = "grafana_dashboard"
FOLDER_ANNOTATION = "grafana_folder"

_DNS_LABEL = re.compile(r"[^a-z0-9-]+")


class ManifestError(ValueError):
    """A source file cannot become a manifest; the message names the file and what to fix."""


@dataclass(frozen=True, slots=True)
class Manifest:
    """One Kubernetes object and the repository file it came from (shown as a comment above it)."""

    source: str
    body: dict[str, Any]


def resource_name(prefix: str, stem: str) -> str:
    """A DNS-1123 name from a file stem: ``kvwatch-slo`` stays, ``KV_cache`` -> ``kvwatch-kv-cache``."""
    name = _DNS_LABEL.sub("-", stem.lower()).strip("-")
    if not name.startswith(prefix):
        name = f"{prefix}-{name}" if name else prefix
    return re.sub(r"-{2,}", "-", name)[:253].rstrip("-")


# --------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------


def _check_strings(mapping: Any, where: str) -> None:
    if mapping is None:
        return
    if not isinstance(mapping, Mapping):
        raise ManifestError(f"{where}: expected a mapping of strings")
    for key, value in mapping.items():
        if not isinstance(value, str):
            raise ManifestError(
                f"{where}.{key}: the PrometheusRule CRD needs a string, got "
                f"{type(value).__name__} {value!r}; quote it in the rule file"
            )


def _check_rule(rule: Any, where: str) -> None:
    if not isinstance(rule, Mapping):
        raise ManifestError(f"{where}: expected a rule mapping")
    unknown = set(rule) - RULE_KEYS
    if unknown:
        raise ManifestError(f"{where}: unknown key(s) {sorted(unknown)} (a rule has {sorted(RULE_KEYS)})")
    if ("alert" in rule) == ("record" in rule):
        raise ManifestError(f"{where}: needs exactly one of 'alert' and 'record'")
    if "expr" not in rule:
        raise ManifestError(f"{where}: needs 'expr'")
    for key in ("labels", "annotations"):
        _check_strings(rule.get(key), f"{where}.{key}")


def _checked_groups(document: Any, source: str) -> list[Any]:
    if not isinstance(document, Mapping) or "groups" not in document:
        raise ManifestError(f"{source}: not a Prometheus rule file (expected a top-level 'groups' list)")
    if set(document) != {"groups"}:
        raise ManifestError(f"{source}: unexpected top-level key(s) {sorted(set(document) - {'groups'})}")
    groups = document["groups"]
    if not isinstance(groups, list) or not groups:
        raise ManifestError(f"{source}: 'groups' must be a non-empty list")
    for i, group in enumerate(groups):
        where = f"{source}: groups[{i}]"
        if not isinstance(group, Mapping) or not group.get("name"):
            raise ManifestError(f"{where}: needs a 'name'")
        unknown = set(group) - GROUP_KEYS
        if unknown:
            raise ManifestError(
                f"{where}: unknown key(s) {sorted(unknown)} (a group has {sorted(GROUP_KEYS)})"
            )
        if not isinstance(group.get("rules"), list):
            raise ManifestError(f"{where}: 'rules' must be a list")
        _check_strings(group.get("labels"), f"{where}.labels")
        for j, rule in enumerate(group["rules"]):
            _check_rule(rule, f"{where}.rules[{j}]")
    return groups


def prometheus_rule(name: str, groups: list[Any], level: str | None = None) -> dict[str, Any]:
    labels = {**COMMON_LABELS, LEVEL_LABEL: level} if level else dict(COMMON_LABELS)
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels},
        "spec": {"groups": groups},
    }


def rule_manifests(sources: Iterable[tuple[str, str]]) -> list[Manifest]:
    """One PrometheusRule per rule file; ``sources`` are ``(path shown to users, YAML text)``.

    Group names must be unique across files, as one Prometheus loads them all.
    """
    manifests: list[Manifest] = []
    seen_groups: dict[str, str] = {}
    seen_names: dict[str, str] = {}
    for source, text in sources:
        try:
            document = safe_load(text)
        except yaml.YAMLError as exc:
            raise ManifestError(f"{source}: not valid YAML: {exc}") from None
        groups = _checked_groups(document, source)
        for group in groups:
            other = seen_groups.setdefault(group["name"], source)
            if other != source:
                raise ManifestError(f"{source}: group {group['name']!r} is also defined in {other}")
        stem = Path(source).name.removesuffix(".yaml").removesuffix(".yml").removesuffix(".rules")
        name = resource_name("kvwatch", stem)
        other = seen_names.setdefault(name, source)
        if other != source:
            raise ManifestError(f"{source} and {other} both become PrometheusRule {name!r}; rename one")
        manifests.append(Manifest(source, prometheus_rule(name, groups, LEVELS.get(Path(source).name))))
    return manifests


# --------------------------------------------------------------------------------------------
# dashboards
# --------------------------------------------------------------------------------------------


def dashboard_configmap(name: str, key: str, text: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {**COMMON_LABELS, DASHBOARD_LABEL: "1"},
            "annotations": {FOLDER_ANNOTATION: "kvwatch"},
        },
        "data": {key: text},
    }


def dashboard_manifests(sources: Iterable[tuple[str, str]]) -> list[Manifest]:
    """One ConfigMap per dashboard JSON, carrying the file's text unchanged (it is what was reviewed)."""
    manifests: list[Manifest] = []
    seen: dict[str, str] = {}
    for source, text in sources:
        try:
            dashboard = loads(text)
        except ValueError as exc:
            raise ManifestError(f"{source}: not valid JSON: {exc}") from None
        if not isinstance(dashboard, dict) or "panels" not in dashboard:
            raise ManifestError(f"{source}: not a Grafana dashboard (expected a JSON object with 'panels')")
        size = len(text.encode("utf-8"))
        if size > CONFIGMAP_MAX_BYTES:
            raise ManifestError(f"{source}: {size} bytes is over a ConfigMap's {CONFIGMAP_MAX_BYTES} bytes")
        stem = Path(source).name.removesuffix(".json")
        name = resource_name("kvwatch-dashboard", stem)
        other = seen.setdefault(name, source)
        if other != source:
            raise ManifestError(f"{source} and {other} both become ConfigMap {name!r}; rename one")
        key = re.sub(r"[^-._a-zA-Z0-9]", "-", Path(source).name)
        manifests.append(Manifest(source, dashboard_configmap(name, key, text)))
    return manifests


# --------------------------------------------------------------------------------------------
# rendering
# --------------------------------------------------------------------------------------------


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, dashboard JSON) as literal blocks, so the manifests stay readable."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(manifests: list[Manifest], what: str) -> str:
    """A multi-document YAML file; with no manifests, a file that kustomize reads as no objects."""
    lines = [
        f"# {what}",
        "# Generated by `kvwatch manifests`. Do not edit: change the sources and re-run it.",
    ]
    if not manifests:
        lines.append("# (no sources yet)")
    out = "\n".join(lines) + "\n"
    for manifest in manifests:
        body = yaml.dump(manifest.body, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=10_000)
        out += f"---\n# source: {manifest.source}\n{body}"
    return out


def _read_sources(directory: Path, patterns: tuple[str, ...], root: Path) -> list[tuple[str, str]]:
    paths = sorted({p for pattern in patterns for p in directory.glob(pattern) if p.is_file()})
    return [(_shown(p, root), p.read_text(encoding="utf-8")) for p in paths]


def _shown(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def generate(alerts_dir: Path, dashboards_dir: Path, root: Path | None = None) -> dict[str, str]:
    """File name -> text for ``deploy/kubernetes/monitoring``. Missing or empty source directories
    give files with no objects, so the kustomizations still build."""
    root = root or Path.cwd()
    rules, boards = [], []
    if alerts_dir.is_dir():
        rules = rule_manifests(_read_sources(alerts_dir, RULE_FILE_PATTERNS, root))
    if dashboards_dir.is_dir():
        boards = dashboard_manifests(_read_sources(dashboards_dir, ("*.json",), root))
    rules_from, boards_from = _shown(alerts_dir, root), _shown(dashboards_dir, root)
    return {
        RULES_FILE: render(rules, f"PrometheusRules from {rules_from}/*.rules.yaml"),
        DASHBOARDS_FILE: render(boards, f"Grafana dashboard ConfigMaps from {boards_from}/*.json"),
    }
