"""The proxy package's shape: an exchange moves only along its phase table, and the package's
modules import each other without a cycle (none hides one under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvwatch.requests.http1 import parse_request_head, parse_response_head
from kvwatch.requests.proxy.client import ClientConnection
from kvwatch.requests.proxy.exchange import TRANSITIONS, Exchange, Phase, PhaseError

from .unstarted import unstarted_proxy

PACKAGE = Path(__file__).resolve().parents[2] / "kvwatch" / "requests" / "proxy"
PREFIX = "kvwatch.requests.proxy."


def package_imports() -> dict[str, set[str]]:
    """Each module of the package -> the package modules it imports (at any level, guarded or not)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("*.py")):
        name = path.stem
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PREFIX):
                found.add(node.module.removeprefix(PREFIX).split(".")[0])
            elif isinstance(node, ast.Import):
                found |= {
                    a.name.removeprefix(PREFIX).split(".")[0] for a in node.names if a.name.startswith(PREFIX)
                }
        graph[name] = found - {name}
    return graph


def test_the_package_import_graph_is_acyclic() -> None:
    graph = package_imports()
    assert {"client", "exchange", "pool", "server"} <= graph.keys()
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if state.get(dep) == "open":
                pytest.fail("import cycle: " + " -> ".join([*path, module, dep]))
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "closed"

    for module in graph:
        if module not in state:
            visit(module, [])


def test_no_module_of_the_package_imports_under_type_checking() -> None:
    for path in PACKAGE.glob("*.py"):
        guarded = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        ]
        assert not guarded, f"{path.name} imports under TYPE_CHECKING (line {guarded[0].lineno})"


def exchange() -> Exchange:
    proxy = unstarted_proxy()
    head = parse_request_head(b"GET /v1/models HTTP/1.1\r\nHost: x")
    return Exchange(proxy.clients.exchanges, ClientConnection(proxy.clients), head, b"", 0.0, 0.0)


def test_an_illegal_phase_transition_raises() -> None:
    ex = exchange()
    assert ex.phase is Phase.SENDING_UPSTREAM
    with pytest.raises(PhaseError, match="from sending upstream to head read"):
        ex._to(Phase.HEAD_READ)  # a response head before the request went out on a connection
    assert ex.phase is Phase.SENDING_UPSTREAM  # a refused move changes nothing


async def test_a_response_head_before_the_request_is_sent_is_refused() -> None:
    """The engine connection's callback order is checked: ``on_head`` on an exchange whose request
    is not on a connection yet is a kvwatch bug, and raises instead of relaying a response."""
    ex = exchange()
    with pytest.raises(PhaseError):
        ex.on_head(parse_response_head(b"HTTP/1.1 200 OK\r\ncontent-length: 0"), 0, False)


def test_ended_phases_are_final_and_every_phase_can_end() -> None:
    assert TRANSITIONS[Phase.DONE] == TRANSITIONS[Phase.FAILED] == frozenset()
    for phase, targets in TRANSITIONS.items():
        if phase not in (Phase.DONE, Phase.FAILED):
            assert {Phase.DONE, Phase.FAILED} <= targets, phase
