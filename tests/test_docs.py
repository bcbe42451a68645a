"""Docs stay true: the generated references are current, every local link resolves and every
repository path a page names in backticks exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_references_are_current():  # docs/metrics.md and docs/config.md
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", "docs", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_every_catalog_family_is_in_the_reference():
    from kvwatch.catalog import CATALOG

    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [s.name for s in CATALOG if f"`{s.series_names[0]}`" not in text]
    assert not missing


def test_local_links_in_readme_and_docs_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


#: a backticked span that is a path in this repository: its first part names a top-level entry, an
#: optional ``:line`` or ``::name`` follows; globs and placeholders (``*``, ``<...>``) are not paths
_REPO_PATH = re.compile(r"([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)*/?)(?::[\w.:-]+)?")
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def backticked_repository_paths(text: str, top: set[str]) -> list[str]:
    """The repository paths a Markdown page names in inline code (fenced blocks are commands)."""
    paths = []
    for span in re.findall(r"`([^`\n]+)`", _FENCED.sub("", text)):
        match = _REPO_PATH.fullmatch(span)
        if match is None:
            continue
        path = match.group(1)
        if path.split("/")[0] in top and ("/" in path or "." in path):
            paths.append(path)
    return paths


def test_backticked_repository_paths_in_readme_and_docs_exist():
    top = {p.name for p in ROOT.iterdir()} - {".venv", ".git"}
    missing = [
        f"{page.relative_to(ROOT)}: `{path}`"
        for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
        for path in backticked_repository_paths(page.read_text(), top)
        if not (ROOT / path).exists()
    ]
    assert not missing, missing


def test_the_path_check_sees_paths_and_passes_over_what_is_not_one():
    top = {"kvwatch", "tests", "README.md"}
    text = (
        "`kvwatch/sim/node.py` and `tests/sim/`, `kvwatch/state.py:120`, `README.md`; not "
        "`vllm/v1/metrics/stats.py`, `kvwatch run`, `tests/**/*.py`, `kvwatch.catalog`\n"
        "```sh\ncat `kvwatch/gone.py`\n```\n"
    )
    assert backticked_repository_paths(text, top) == [
        "kvwatch/sim/node.py",
        "tests/sim/",
        "kvwatch/state.py",
        "README.md",
    ]


def test_readme_opens_with_the_two_set_up_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```sh") + 1 : lines.index("```sh") + 3]
    assert block[0].endswith("kvwatch demo")
    assert "setup-test-env.sh" in block[1] and "pytest" in block[1]
    assert "scripts/setup-test-env.sh" in (ROOT / ".ci" / "run").read_text()
