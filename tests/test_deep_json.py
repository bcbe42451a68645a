"""JSON nested deeper than the interpreter's recursion limit, from every reader of JSON kvwatch did
not write: ``json.loads`` raises RecursionError there, not ValueError, so each reader's ``except
ValueError`` let it through (a traceback from ``kvwatch report``, a failed watch, a dropped export).
Each case gets the reader's own clear error or its "not JSON" verdict, and what came beside it is
kept (the relay workers' channel: tests/requests/test_proxy_workers.py). A static check keeps every
such read on ``kvwatch.jsonsafe.loads``."""

from __future__ import annotations

import ast
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvwatch.discovery.kube_api import StreamError, decode_event
from kvwatch.engines.llamacpp import SlotsError, parse_slots
from kvwatch.jsonsafe import TooDeepError, loads
from kvwatch.model import Outcome
from kvwatch.plan.jsonl import json_lines
from kvwatch.report import build_report
from kvwatch.requests.accounting import inspect_request
from kvwatch.requests.otlp import records_from_export
from kvwatch.requests.sglang_files import line_record
from kvwatch.requests.sse import read_usage_event, usage_from_body
from kvwatch.requests.vllm_plugin import DatagramError, decode
from kvwatch.sim.workload import TraceError, load_trace
from tests.report import ledgers
from tests.requests.otlp_spans import TOKENS, model_labels, one_replica, span_export

ROOT = Path(__file__).resolve().parents[1]
#: deeper than any recursion limit a Python process runs with, and only ~40 KB
DEPTH = max(20_000, sys.getrecursionlimit() * 4)
ARRAY = "[" * DEPTH + "]" * DEPTH
OBJECT = '{"a":' * DEPTH + "1" + "}" * DEPTH


def _raw_loads_raises_recursion_error() -> bool:
    import json

    try:
        json.loads(ARRAY)
    except RecursionError:
        return True
    return False


def test_the_hazard_is_real_and_loads_turns_it_into_a_value_error() -> None:
    assert _raw_loads_raises_recursion_error(), "json.loads no longer raises RecursionError: drop this file"
    for text in (ARRAY, OBJECT, ARRAY.encode()):
        with pytest.raises(TooDeepError):
            loads(text)
        with pytest.raises(ValueError, match="nested too deeply"):
            loads(text)
    assert loads("[" * 100 + "]" * 100) == loads(b"[" * 100 + b"]" * 100)  # shallow nesting is JSON as before


@pytest.mark.parametrize("deep", [ARRAY, OBJECT], ids=["array", "object"])
def test_watch_stream_line_is_malformed(deep: str) -> None:
    with pytest.raises(StreamError) as caught:
        decode_event(f'{{"type":"ADDED","object":{deep}}}'.encode())
    assert caught.value.reason == "malformed"


def test_llamacpp_slots_page() -> None:
    with pytest.raises(SlotsError, match="not JSON"):
        parse_slots(ARRAY)


def test_proxy_request_body_is_passed_on_unmetered() -> None:
    info = inspect_request(f'{{"model":"m","messages":{ARRAY}}}'.encode(), "chat")
    assert not info.parsed and info.model is None and not info.streaming


def test_usage_event_and_body() -> None:
    event = b'data: {"usage":{"prompt_tokens":1},"x":' + ARRAY.encode() + b"}"
    with pytest.raises(TooDeepError):  # the relay counts it as an accounting error (test_proxy_relay.py)
        read_usage_event(event)
    assert usage_from_body(b'{"usage":{"prompt_tokens":1},"x":' + ARRAY.encode() + b"}") == (None, None)


def test_otlp_finish_reasons_attribute_is_a_plain_string() -> None:
    export = span_export({}, **{TOKENS: 3, "gen_ai.response.finish_reasons": ARRAY})
    [record], _ = records_from_export(export, one_replica(), model_labels())
    assert record.outcome is Outcome.COMPLETED and record.finish_reason == "other"  # an unknown reason


def test_vllm_plugin_datagram() -> None:
    with pytest.raises(DatagramError) as caught:
        decode(ARRAY[:60_000].encode(), "r0", "m")
    assert caught.value.result == "malformed"


def test_sglang_request_dump_parameters() -> None:
    doc = {
        "rid": "a",
        "finish_reason": {"type": "length", "length": 5},
        "completion_tokens": 5,
        "prompt_tokens": 3,
        "request_parameters": '{"sampling_params":' + ARRAY + "}",
    }
    record = line_record(doc, "r0", "m", 1_700_000_000.0)
    assert record.max_tokens is None and record.output_tokens == 5


def test_report_counts_the_line_as_not_json_and_keeps_the_rest(tmp_path: Path) -> None:
    path = ledgers.write(tmp_path / "ledger.jsonl", ledgers.HAND, extra_lines={1: ARRAY, 2: OBJECT})
    report = build_report([str(path)])
    assert report.requests == len(ledgers.HAND)
    assert dict(report.malformed_reasons)["not JSON"] == 2


def test_plan_json_lines_and_trace_files_name_the_line(tmp_path: Path) -> None:
    class PlanError(ValueError):
        pass

    with pytest.raises(PlanError, match=r"x\.jsonl line 2: not JSON"):
        list(json_lines(["{}", ARRAY], "x.jsonl", PlanError))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 5, "output_length": 5}\n' + ARRAY + "\n")
    with pytest.raises(TraceError, match="line 2: not JSON"):
        load_trace(trace)


def test_async_off_loop_list_decode_raises_value_error() -> None:
    """The pod list decodes in a thread when large: the same ValueError comes back through to_thread."""

    async def decode_in_thread() -> Any:
        return await asyncio.to_thread(loads, ARRAY)

    with pytest.raises(ValueError, match="nested too deeply"):
        asyncio.run(decode_in_thread())


# -- every read of outside JSON goes through jsonsafe.loads ----------------------------------------

RAW_JSON_READS: dict[str, Callable[[ast.Call], bool]] = {
    "json.loads or json.load": lambda call: (
        isinstance(call.func, ast.Attribute)
        and call.func.attr in ("loads", "load")
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "json"
    ),
    "<response>.json()": lambda call: (
        isinstance(call.func, ast.Attribute)
        and call.func.attr == "json"
        and not call.args
        and not call.keywords
    ),
}


def test_no_module_reads_json_around_jsonsafe() -> None:
    found = []
    for path in sorted((ROOT / "kvwatch").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "kvwatch/jsonsafe.py" or rel.startswith("kvwatch/third_party/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Call):
                found += [f"{rel}:{node.lineno}: {what}" for what, hit in RAW_JSON_READS.items() if hit(node)]
    # the dashboards' own builders are Board.json(): kvwatch's output, not input
    assert [f for f in found if not f.startswith("kvwatch/mixin/dashboards/")] == []
