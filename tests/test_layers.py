"""The layer table of docs/architecture.md, enforced: every ``kvwatch`` import inside ``kvwatch/`` must
point at the importer's own package or at a layer its row allows. The table is read from the doc,
so the doc and this test cannot say different things."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvwatch"
ROW = re.compile(r"^\| (?P<layer>[a-z]+) \| (?P<modules>(?:`[^`]+` ?)+) \| (?P<allowed>[a-z, ]+) \|$")


def layer_table(doc: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(top-level module or package -> layer, layer -> layers it may import) from the doc's table."""
    unit_layer: dict[str, str] = {}
    allowed: dict[str, set[str]] = {}
    for match in map(ROW.match, doc.splitlines()):
        if match is None:
            continue
        layer = match["layer"]
        allowed[layer] = {name.strip() for name in match["allowed"].split(",")} - {"nothing"}
        for module in re.findall(r"`([^`]+)`", match["modules"]):
            unit_layer[module.removesuffix("/").removesuffix(".py")] = layer
    return unit_layer, allowed


def unit_of(module: str) -> str:
    """``kvwatch.engines.vllm`` -> ``engines``; ``kvwatch`` (its ``__init__``) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


#: a string that names a kvwatch module, optionally with ``:attribute`` (an import by name at run time)
MODULE_STRING = re.compile(r"kvwatch(?:\.[A-Za-z_]\w*)+(?::[A-Za-z_]\w*)?")
IMPORT_CALLS = ("importlib.import_module", "import_module", "__import__")


def imports(path: Path) -> set[str]:
    """Every kvwatch module a file imports, at any depth (``from kvwatch import x`` names ``kvwatch.x``),
    and every string constant shaped like a module path with a ``:function`` (a handler named by string
    is an import the interpreter only makes later) or passed to ``importlib.import_module``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "kvwatch")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kvwatch":
            if node.module == "kvwatch":
                found.update(f"kvwatch.{a.name}" for a in node.names)
            else:
                found.add(node.module)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and MODULE_STRING.fullmatch(node.value)
            and ":" in node.value
        ):
            found.add(node.value.split(":")[0])
        elif (
            isinstance(node, ast.Call)
            and ast.unparse(node.func) in IMPORT_CALLS
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def exists(target: str, package: Path) -> bool:
    """``kvwatch.a.b`` is a module or package (a namespace one too) under ``package``, or a name
    ``kvwatch/__init__.py`` defines."""
    path = package.parent.joinpath(*target.split("."))
    if path.with_suffix(".py").is_file() or (path.is_dir() and any(path.glob("*.py"))):
        return True
    init = package / "__init__.py"
    name = target.rsplit(".", maxsplit=1)[-1]
    return (
        target.count(".") == 1
        and init.is_file()
        and any(
            (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store))
            or (isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name)
            for node in ast.walk(ast.parse(init.read_text(encoding="utf-8")))
        )
    )


def upward_imports(package: Path, unit_layer: dict[str, str], allowed: dict[str, set[str]]) -> list[str]:
    bad = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).with_suffix("")
        unit = unit_of(".".join(rel.parts))
        for target in sorted(imports(path)):
            if not exists(target, package):
                bad.append(f"{rel}.py ({unit_layer[unit]}) imports {target}, which does not exist")
                continue
            to = unit_of(target) if unit_of(target) in unit_layer else "__init__"  # kvwatch.__version__
            if to != unit and unit_layer[to] not in allowed[unit_layer[unit]]:
                bad.append(f"{rel}.py ({unit_layer[unit]}) imports {target} ({unit_layer[to]})")
    return bad


def test_every_module_has_a_layer_and_every_layer_is_named():
    unit_layer, allowed = layer_table((ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    units = {
        p.stem if p.is_file() else p.name
        for p in PACKAGE.iterdir()
        if (p.suffix == ".py") or (p / "__init__.py").exists()
    }
    assert units == set(unit_layer), "docs/architecture.md's layer table and kvwatch/ list different modules"
    assert set().union(*allowed.values()) <= set(allowed)


def test_no_import_points_up_a_layer():
    table = layer_table((ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    assert upward_imports(PACKAGE, *table) == []


def test_upward_and_sideways_imports_are_caught_even_inside_functions(tmp_path):
    package = tmp_path / "kvwatch"
    (package / "engines").mkdir(parents=True)
    (package / "model.py").write_text("def f():\n    from kvwatch.state import NodeState\n")
    (package / "engines" / "vllm.py").write_text(
        "from kvwatch.engines import base\nimport kvwatch.gpu.nvml\n"
    )
    (package / "derive.py").write_text("from kvwatch import model, config\n")
    for module in ("__init__", "state", "model", "config", "engines/__init__", "engines/base", "gpu/nvml"):
        (package / f"{module}.py").parent.mkdir(parents=True, exist_ok=True)
        (package / f"{module}.py").touch()
    table = layer_table((ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    assert upward_imports(package, *table) == [
        "kvwatch/derive.py (derive) imports kvwatch.config (config)",
        "kvwatch/engines/vllm.py (sources) imports kvwatch.gpu.nvml (sources)",
        "kvwatch/model.py (records) imports kvwatch.state (state)",
    ]


def test_a_misspelled_module_and_a_string_named_upward_handler_are_caught(tmp_path):
    package = tmp_path / "kvwatch"
    (package / "engines").mkdir(parents=True)
    for module in ("__init__", "model", "engines/__init__", "engines/page_worker"):
        (package / f"{module}.py").touch()
    (package / "__init__.py").write_text('__version__ = "1"\n')
    (package / "derive.py").write_text("from kvwatch import modle, __version__\nimport kvwatch.model\n")
    (package / "workers.py").write_text(
        'HANDLERS = {"page": "kvwatch.engines.page_worker:answer"}\nLOGGER = "kvwatch.workers"\n'
    )
    (package / "tasks.py").write_text("import importlib\nimportlib.import_module('kvwatch.engines')\n")
    table = layer_table((ROOT / "docs/architecture.md").read_text(encoding="utf-8"))
    assert upward_imports(package, *table) == [
        "kvwatch/derive.py (derive) imports kvwatch.modle, which does not exist",
        "kvwatch/tasks.py (runtime) imports kvwatch.engines (sources)",
        "kvwatch/workers.py (runtime) imports kvwatch.engines.page_worker (sources)",
    ]
