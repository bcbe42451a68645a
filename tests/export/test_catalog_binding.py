"""The export collectors bind their catalog specs at import, and the catalog's ``kind`` and ``area`` are
checked types: a misspelled family, kind or area fails at import (and in mypy), never as a failed export
area at scrape time."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from kvwatch.catalog import BY_NAME, Area, Kind, MetricSpec

ROOT = Path(__file__).resolve().parents[2]
EXPORT = ROOT / "kvwatch" / "export"
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)


#: the catalog's look-ups: one family, several, a table of (family, value) rows
LOOKUPS = {"spec", "specs", "spec_rows"}


def _lookup_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LOOKUPS:
        return node.func.id
    return None


def late_lookups(source: str) -> list[str]:
    """Where a module names a catalog family other than at import through the catalog: a look-up inside
    a function or class, or a family name that is not an argument of a module-level look-up."""
    tree = ast.parse(source)
    parent: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parent[child] = node

    def ancestors(node: ast.AST) -> list[ast.AST]:
        out = []
        while node in parent:
            node = parent[node]
            out.append(node)
        return out

    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        lookup = _lookup_name(node)
        if lookup is not None and any(isinstance(a, SCOPES) for a in ancestors(node)):
            found.append((node.lineno, f"{lookup}() called at run time"))
        elif isinstance(node, ast.Constant) and node.value in BY_NAME:
            up = ancestors(node)
            if any(isinstance(a, SCOPES) for a in up) or not any(map(_lookup_name, up)):
                found.append((node.lineno, f"{node.value} not looked up at import"))
    return [f"line {line}: {what}" for line, what in sorted(found)]


def test_every_family_an_export_module_names_is_looked_up_at_import():
    modules = sorted(EXPORT.glob("*.py"))
    assert len(modules) > 5
    found = {p.name: late_lookups(p.read_text(encoding="utf-8")) for p in modules}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_check_sees_a_run_time_lookup_and_a_bare_name():
    source = (
        "from kvwatch.catalog import spec, spec_rows, specs\n"
        'UP = spec("kvwatch_target_up")\n'
        'TABLE = spec_rows(("kvwatch_kv_usage_ratio", "kv_usage_ratio"))\n'
        'NAMES = frozenset(f.name for f in specs("kvwatch_requests", "kvwatch_build"))\n'
        'RAW = (("kvwatch_kv_used_tokens", "kv_used_tokens"),)\n'
        "def collect():\n"
        '    return spec("kvwatch_build").info()\n'
        "def rows():\n"
        '    return specs("kvwatch_requests")\n'
    )
    assert late_lookups(source) == [
        "line 5: kvwatch_kv_used_tokens not looked up at import",
        "line 7: kvwatch_build not looked up at import",
        "line 7: spec() called at run time",
        "line 9: kvwatch_requests not looked up at import",
        "line 9: specs() called at run time",
    ]


def _import_file(path: Path) -> None:
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    assert module_spec is not None and module_spec.loader is not None
    module_spec.loader.exec_module(importlib.util.module_from_spec(module_spec))


def test_a_misspelled_family_fails_when_its_module_is_imported(tmp_path):
    good = tmp_path / "bound_well.py"
    good.write_text('from kvwatch.catalog import spec\nTTFT = spec("kvwatch_request_ttft_seconds")\n')
    _import_file(good)
    wrong = tmp_path / "bound_wrong.py"
    wrong.write_text(
        "from kvwatch.catalog import spec, spec_rows\n"
        'TTFT = spec("kvwatch_request_ttft_seconds")\n'
        'ROWS = spec_rows(("kvwatch_request_ttft_seconds", 1), ("kvwatch_request_tpot_secnods", 2))\n'
        "def collect():\n"
        "    return TTFT.histogram()\n"
    )
    with pytest.raises(KeyError, match="kvwatch_request_tpot_secnods is not in kvwatch's metric catalog"):
        _import_file(wrong)


def test_a_kind_or_area_outside_its_literal_is_refused_when_built():
    with pytest.raises(ValueError, match="gauges"):
        MetricSpec("kvwatch_x", "gauges", (), "help", "self")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slef"):
        MetricSpec("kvwatch_x", "gauge", (), "help", "slef")  # type: ignore[arg-type]


def test_every_kind_has_its_family_factory_and_every_area_is_used():
    """``export/gpus.py`` builds a family with ``getattr(spec, spec.kind)()``."""
    assert all(callable(getattr(MetricSpec, kind)) for kind in get_args(Kind))
    assert {s.area for s in BY_NAME.values()} == set(get_args(Area))
    assert {s.kind for s in BY_NAME.values()} == set(get_args(Kind))


def test_mypy_refuses_a_kind_or_area_outside_its_literal(tmp_path):
    (tmp_path / "wrong.py").write_text(
        "from kvwatch.catalog import MetricSpec\n\n"
        'MetricSpec("kvwatch_x", "gauges", (), "help", "self")\n'
        'MetricSpec("kvwatch_x", "gauge", (), "help", "slef")\n'
        'MetricSpec("kvwatch_x", "gauge", (), "help", "self")\n'
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            os.devnull,
            "--cache-dir",
            str(tmp_path / "cache"),
            "wrong.py",
        ],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "MYPYPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout + result.stderr
    assert errors[0].startswith("wrong.py:3:") and "Literal['gauges']" in errors[0]
    assert errors[1].startswith("wrong.py:4:") and "Literal['slef']" in errors[1]
