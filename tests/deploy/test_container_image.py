"""The Dockerfile and .dockerignore, checked structurally (no Docker daemon or hadolint here)."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib
from pathlib import Path

from kvwatch.config import DEFAULT_LISTEN, parse_host_port

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text(encoding="utf-8")


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    return [(ins.upper(), rest.strip()) for ins, _, rest in (li.strip().partition(" ") for li in logical)]


INSTRUCTIONS = _instructions(DOCKERFILE)


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins, args in INSTRUCTIONS:
        if ins == "FROM":
            stages.append([])
        if stages:
            stages[-1].append((ins, args))
    return stages


def _final(instruction: str) -> list[str]:
    return [args for ins, args in _stages()[-1] if ins == instruction]


def test_base_image_is_a_pinned_python_311_slim_for_every_stage() -> None:
    [arg] = [a for i, a in INSTRUCTIONS if i == "ARG" and a.startswith("PYTHON_IMAGE=")]
    image = arg.split("=", 1)[1]
    assert re.fullmatch(r"python:3\.11(\.\d+)?-slim(-\w+)?(@sha256:[0-9a-f]{64})?", image), image
    assert not image.endswith(":latest")
    froms = [a for i, a in INSTRUCTIONS if i == "FROM"]
    assert len(froms) >= 2  # multi-stage: build tools stay in the first
    assert all(f.split()[0] == "${PYTHON_IMAGE}" for f in froms)


def test_final_stage_installs_nothing_and_runs_as_nobody() -> None:
    final = _stages()[-1]
    assert not [a for i, a in final if i == "RUN"], "the final stage must not run installers"
    assert _final("USER") == ["65534:65534"]
    assert [a for i, a in final if i == "COPY"] == ["--from=build /opt/kvwatch /opt/kvwatch"]


def test_build_stage_installs_the_project_and_removes_pip_from_what_it_ships() -> None:
    [run] = [a for i, a in _stages()[0] if i == "RUN"]
    assert 'pip install ".[fast]"' in run
    assert "pip uninstall --yes pip setuptools wheel" in run
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "fast" in extras


def test_no_add_of_remote_urls_and_no_shell_form_entrypoint() -> None:
    assert not [a for i, a in INSTRUCTIONS if i == "ADD"]
    assert json.loads(_final("ENTRYPOINT")[0]) == ["kvwatch"]
    assert json.loads(_final("CMD")[0]) == ["run", "--config", "/etc/kvwatch/kvwatch.yaml"]


def test_exposes_and_health_checks_the_agents_default_listen_port() -> None:
    from prometheus_client import CollectorRegistry

    from kvwatch.export.server import metrics_app

    port = parse_host_port(DEFAULT_LISTEN).port
    assert _final("EXPOSE") == [str(port)]
    [healthcheck] = _final("HEALTHCHECK")
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\S+?)'", healthcheck)
    assert url and int(url.group(1)) == port
    routes = {r.resource.canonical for r in metrics_app(CollectorRegistry(), lambda: True).router.routes()}
    assert url.group(2) in routes
    assert "curl" not in healthcheck and "wget" not in healthcheck  # neither is in a slim image


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        candidates = [path, *(str(p) for p in Path(path).parents if str(p) != ".")]
        patterns = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatch(c, p) for c in candidates for p in patterns):
            excluded = not negate
    return excluded


def test_dockerignore_sends_only_what_the_build_copies() -> None:
    for path in ("pyproject.toml", "README.md", "kvwatch/cli.py"):
        assert not _dockerignore_excludes(path), path
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "tests/deploy/test_container_image.py",
        "bench/x.py",
        "kvwatch/__pycache__/cli.cpython-311.pyc",
        "kvwatch.egg-info/PKG-INFO",
    ):
        assert _dockerignore_excludes(path), path


def test_every_copy_source_is_in_the_build_context() -> None:
    for args in (a for i, a in _stages()[0] if i == "COPY"):
        for source in args.split()[:-1]:
            assert (ROOT / source).exists() and not _dockerignore_excludes(source), source
