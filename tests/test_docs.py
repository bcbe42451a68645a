"""Docs stay true: the generated references are current and every local link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_references_are_current():  # docs/metrics.md and docs/config.md
    result = subprocess.run([sys.executable, "-m", "kvwatch", "docs", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=60, check=False)
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


def test_readme_opens_with_the_two_set_up_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```sh") + 1: lines.index("```sh") + 3]
    assert block[0].endswith("kvwatch demo")
    assert "setup-test-env.sh" in block[1] and "pytest" in block[1]
    assert "scripts/setup-test-env.sh" in (ROOT / ".ci" / "run").read_text()
