"""docs/config.md's reference, rendered from the schema: every key, kind, default, bounds, doc, variable.

Pure: schema in, Markdown out (``kvwatch docs`` puts it in the file, ``--check`` compares).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvwatch.config.loader import env_variable
from kvwatch.config.schema import Config
from kvwatch.config.validate import DURATION, SIZE, HostPort, default_of, is_required, schema_fields
from kvwatch.model import LengthBands

_HEADER = ["| key | type | default | bounds | environment | meaning |", "|---|---|---|---|---|---|"]


def reference() -> str:
    """The generated region of docs/config.md: one table per section, top level first."""
    lines: list[str] = []
    for title, rows in _tables(Config, (), env=True):
        lines += [f"### {title}", "", *_HEADER, *rows, ""]
    return "\n".join(lines).rstrip("\n")


def _tables(cls: type, path: tuple[str, ...], env: bool) -> list[tuple[str, list[str]]]:
    """(title, rows) for ``cls`` and, after it, each of its sections and lists of entries."""
    rows: list[str] = []
    nested: list[tuple[str, list[str]]] = []
    prefix = "".join(f"{p}." for p in path)
    for key, f in schema_fields(cls).items():
        meta = f.metadata
        where = (*path, key)
        variable = f"`{env_variable(where)}`" if env else "-"
        if "section" in meta:
            nested += _tables(meta["section"], where, env)
        elif "entries" in meta:
            rows.append(
                f"| `{prefix}{key}` | list of `{key}[]` entries | `[]` | - | "
                f"{variable} (the whole list, as YAML) | {meta['doc']} |"
            )
            nested += _tables(meta["entries"], (*path, f"{key}[]"), env=False)
        else:
            rows.append(
                f"| `{prefix}{key}` | {meta['kind'].name} | {_default(f)} | {_bounds(meta)} | "
                f"{variable} | {meta['doc']} |"
            )
    title = f"`{'.'.join(path)}`" if path else "Top level"
    return ([(title, rows)] if rows else []) + nested


def _default(f: dataclasses.Field[Any]) -> str:
    if is_required(f):
        return "required"
    shown = f.metadata.get("shown_default")
    if shown is not None:
        return f"`{shown}`" if shown[:1] in "[0123456789" or ":" in shown else shown
    value = default_of(f)
    if value is None:
        return "unset"
    return f"`{_yaml(f.metadata.get('kind'), value)}`"


def _yaml(kind: Any, value: Any) -> str:
    """How the value would be written in the file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if kind is DURATION:
        return f"{value:g}s"
    if kind is SIZE:
        return _size(int(value))
    if isinstance(value, HostPort):
        return str(value)
    if isinstance(value, LengthBands):
        value = value.edges
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _size(size: int) -> str:
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


def _bounds(meta: Any) -> str:
    parts = []
    if "min" in meta:
        parts.append(f"≥ {meta['min']:g}")
    if "choices" in meta:
        parts.append("one of " + ", ".join(f"`{c}`" for c in meta["choices"]))
    return "; ".join(parts) or "-"
