"""kvwatch top: the terminal renderer and the command against a live agent's /status.json."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings

from kvwatch.cli import main
from kvwatch.status.top import kv_bar, render_text, status_url
from kvwatch.status.view import build_view, view_from_dict, view_to_dict
from tests.hostile import hostile
from tests.local import free_port

from .node import T0, populated_state
from .server import serve


def test_kv_bar_shows_live_allocated_and_free() -> None:
    assert kv_bar(0.7, 0.4) == "[####---...]"
    assert kv_bar(0.0, 0.0) == "[..........]"
    assert kv_bar(1.0, 1.0) == "[##########]"
    assert kv_bar(0.2, 0.5) == "[#####.....]"  # live never drawn shorter than allocated


def test_render_text_fits_the_width_and_marks_rows_to_look_at() -> None:
    state, cfg = populated_state()
    text = render_text(build_view(state, cfg, T0 + 11), 100)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert lines[0].startswith("kvwatch gpu-node-7")
    assert any(line.startswith("!s0") for line in lines)  # down
    assert any(line.startswith("r1 ") for line in lines)
    assert "Latency and outcomes by output-length band" in text
    assert "\x1b" not in text


def test_render_text_unlimited_width_keeps_whole_rows() -> None:
    state, cfg = populated_state()
    text = render_text(build_view(state, cfg, T0 + 11), 0)
    assert "in flight" in text and "gen5 x16 (max gen5 x16)" in text


def test_status_url_accepts_host_port_and_refuses_other_schemes() -> None:
    assert status_url("gpu-node-7:9477") == "http://gpu-node-7:9477/status.json"
    assert status_url("http://h:1/") == "http://h:1/status.json"
    assert status_url("http://h:1/status.json") == "http://h:1/status.json"
    from kvwatch.status.top import AgentUnreachableError

    with pytest.raises(AgentUnreachableError, match="http"):
        status_url("file:///etc/passwd")


async def test_top_once_prints_the_agents_view(capsys: pytest.CaptureFixture[str]) -> None:
    state, cfg = populated_state()
    async with serve(state, cfg) as base:
        code = await asyncio.to_thread(main, ["top", "--url", base, "--once"])
    out = capsys.readouterr().out
    assert code == 0
    assert "kvwatch gpu-node-7" in out and "r0" in out and "NVIDIA H200" in out
    assert "\x1b[" not in out  # piped: no screen control


def test_top_once_names_an_unreachable_agent(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["top", "--url", url, "--once", "--timeout", "5"]) == 1
    err = capsys.readouterr().err
    assert f"cannot reach kvwatch at {url}/status.json" in err


def _answering(reply: bytes) -> tuple[str, threading.Thread]:
    """A loopback server that answers one connection with ``reply`` and closes."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", thread


def test_top_once_names_a_server_that_is_not_http(capsys: pytest.CaptureFixture[str]) -> None:
    url, thread = _answering(b"SSH-2.0-OpenSSH_9.6\r\n")  # BadStatusLine was a traceback
    assert main(["top", "--url", url, "--once", "--timeout", "5"]) == 1
    thread.join(5)
    assert f"cannot reach kvwatch at {url}/status.json: BadStatusLine" in capsys.readouterr().err


def test_top_once_refuses_a_status_document_over_its_budget(capsys: pytest.CaptureFixture[str]) -> None:
    from kvwatch.status.top import MAX_STATUS_BYTES

    body = b'{"view": "' + b"x" * MAX_STATUS_BYTES + b'"}'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    url, thread = _answering(head + body)  # it was cut at the budget and read as "not JSON"
    assert main(["top", "--url", url, "--once", "--timeout", "5"]) == 1
    thread.join(5)
    assert f"over {MAX_STATUS_BYTES} bytes" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--interval", "--timeout"])
@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1e300"])
def test_top_refuses_a_wait_that_is_not_positive(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["top", "--url", url, "--once", flag, value]) == 2
    assert f"{flag} must be a positive number of seconds" in capsys.readouterr().err


HOSTILE = "\x1b[2J\x1b[31mALL GPUS DOWN\x07\x0d\x9b0m\u202eevil\x85"


async def test_top_escapes_control_characters_an_engine_sent(capsys: pytest.CaptureFixture[str]) -> None:
    state, cfg = populated_state()
    state.target("s0").last_error = HOSTILE  # an engine's error text reaches the down replica's row
    text = render_text(build_view(state, cfg, T0 + 11), 0)
    assert not any(ch in text for ch in "\x1b\x07\r\x9b\u202e\x85")
    assert r"\x1b[2J\x1b[31mALL GPUS DOWN\x07\x0d\x9b0m\u202eevil" in text  # visible, not obeyed
    from kvwatch.status.top import terminal_safe

    assert terminal_safe("qwen3 – 8B ✓") == "qwen3 – 8B ✓"  # printable text is left alone
    async with serve(state, cfg) as base:  # the same through /status.json and `kvwatch top`
        assert await asyncio.to_thread(main, ["top", "--url", base, "--once"]) == 0
    out = capsys.readouterr().out
    assert r"\x1b[2J" in out and not any(ch in out for ch in "\x1b\x07\r\x9b\u202e\x85")


_STATE, _CONFIG = populated_state(step=1)
VIEW = view_to_dict(build_view(_STATE, _CONFIG, T0 + 11))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile(VIEW, changes=3))
def test_a_status_document_of_another_shape_is_refused_or_rendered(document) -> None:
    """An agent of another version (or not an agent) may send any value in any field: ``kvwatch top``
    refuses the document as fetch_view does (a ValueError, TypeError or KeyError becomes "not a kvwatch
    status document"), or renders it; before, a string where a ratio goes failed mid-render with a
    traceback."""
    try:
        view = view_from_dict(document)
    except (KeyError, TypeError, ValueError):
        return
    render_text(view, 120)
    render_text(view, 0)
