"""One import style for the tests' helpers: ``from tests.x import`` or relative (``from .x import``).

A folder's bare name (``from status.x import``) works only because pytest puts ``tests/`` on the path
for the test files in it, and it imports a second copy of the module beside ``tests.status.x``. A
test module is no helper: importing one (or conftest) runs its fixtures and marks in the importer's
namespace, so shared code lives in a helper module.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
#: names a bare import could reach through pytest's path insertion: tests/'s folders and modules
BARE = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("*.py"))} | {
    p.stem for p in TESTS.glob("*.py")
}


def wrong_imports(tree: ast.Module) -> list[str]:
    """The imports of one file that break the style, as written."""
    wrong = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            if node.level == 0 and parts[0] in BARE:
                wrong.append(f"from {node.module} import (bare folder or module name)")
            elif (node.level or parts[0] == "tests") and any(
                part.startswith("test_") or part == "conftest" for part in parts
            ):
                wrong.append(f"from {'.' * node.level}{node.module} import (a test module)")
        elif isinstance(node, ast.Import):
            wrong += [f"import {a.name} (bare name)" for a in node.names if a.name.split(".")[0] in BARE]
    return wrong


def test_tests_import_helpers_by_one_style() -> None:
    found = {
        str(path.relative_to(TESTS)): wrong
        for path in sorted(TESTS.rglob("*.py"))
        if "fixtures" not in path.parts and (wrong := wrong_imports(ast.parse(path.read_text())))
    }
    assert not found, found


def test_the_check_catches_the_styles_it_forbids() -> None:
    before = (
        "from status.test_page_chromium import dump_dom\n"
        "from export.node import full_node_registry\n"
        "from .test_encode import Frozen\n"
        "from tests.conftest import engine\n"
        "import local\n"
    )
    assert len(wrong_imports(ast.parse(before))) == 5
    after = (
        "from tests.status.chromium import dump_dom\n"
        "from .node import full_node_registry\n"
        "from aiohttp.test_utils import TestClient\n"
    )
    assert wrong_imports(ast.parse(after)) == []
