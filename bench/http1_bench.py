"""Cost of the proxy's HTTP/1 validation on the hot path: this checkout's http1.py against another's.

Per upstream read of a stream the proxy de-chunks one chunk (``ChunkedDecoder.feed``, fast path);
per request it parses a head. Both are timed here for this checkout and for a baseline
``http1.py`` (an older checkout's, e.g. one from before the RFC 9112 checks), in the same process,
interleaved, best of several repeats:

  git show 70dc853:kvwatch/requests/http1.py > /tmp/http1_before.py
  .venv/bin/python bench/http1_bench.py --baseline /tmp/http1_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import timeit
from pathlib import Path
from types import ModuleType

from kvwatch.requests import http1

#: a vLLM chat chunk as it arrives from the engine, one per read
EVENT = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1700000000,'
    b'"model":"bench","choices":[{"index":0,"delta":{"content":"tok"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n'
)
REQUEST_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
    b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\nAccept: application/json\r\n"
    b"Content-Type: application/json\r\nUser-Agent: OpenAI/Python 1.55.0\r\n"
    b"X-Stainless-Lang: python\r\nAuthorization: Bearer sk-x\r\nContent-Length: 120"
)


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("http1_baseline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def per_call_ns(stmt, number: int, repeat: int) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=repeat)) / number * 1e9


def measure(module: ModuleType, number: int, repeat: int) -> dict[str, float]:
    chunk = module.frame_chunk(EVENT)
    decoder = module.ChunkedDecoder()
    return {
        "chunk (fast path)": per_call_ns(lambda: decoder.feed(chunk), number, repeat),
        "request head": per_call_ns(lambda: module.parse_request_head(REQUEST_HEAD), number // 10, repeat),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--baseline", type=Path, required=True, help="another checkout's kvwatch/requests/http1.py"
    )
    p.add_argument("--number", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    baseline = load(args.baseline)
    rows: dict[str, list[float]] = {}
    for _ in range(3):  # interleaved, so drift from other load hits both alike
        for i, module in enumerate((baseline, http1)):
            for name, ns in measure(module, args.number, args.repeat).items():
                row = rows.setdefault(name, [float("inf")] * 2)
                row[i] = min(row[i], ns)
    print("| per call | baseline | this checkout | ratio |\n|---|---|---|---|")
    for name, (before, after) in rows.items():
        print(f"| {name} | {before:,.0f} ns | {after:,.0f} ns | {after / before:.2f} |")


if __name__ == "__main__":
    main()
