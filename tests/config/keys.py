"""The config schema's key paths, walked from its dataclasses: the key tests and the config property test
name every key this way, so a key added to the schema is tested without a list to update."""

from __future__ import annotations

from kvwatch.config.schema import Config
from kvwatch.config.validate import schema_fields


def leaf_keys(cls: type = Config, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every key a variable may set: the scalars of every section, and each list of entries whole."""
    out: list[tuple[str, ...]] = []
    for key, f in schema_fields(cls).items():
        if "section" in f.metadata:
            out += leaf_keys(f.metadata["section"], (*path, key))
        else:
            out.append((*path, key))
    return out


def every_key_path(cls: type = Config, prefix: str = "") -> set[str]:
    """``intervals.gpu``, ``replicas[].name``, ``discovery.kubernetes``: every key and section path."""
    out: set[str] = set()
    for key, f in schema_fields(cls).items():
        here = prefix + key
        out.add(here)
        if "section" in f.metadata:
            out |= every_key_path(f.metadata["section"], here + ".")
        elif "entries" in f.metadata:
            out |= every_key_path(f.metadata["entries"], here + "[].")
    return out
