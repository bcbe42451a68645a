"""Cost of the proxy's HTTP/1 validation on the hot path: this checkout's http1.py against another's.

Per upstream read of a stream the proxy de-chunks one chunk (``ChunkedDecoder.feed``, fast path);
per request it parses a head. Both are timed here for this checkout and for a baseline
``http1.py`` (an older checkout's, e.g. one from before the RFC 9112 checks), in the same process,
interleaved, best of several repeats:

  git show 70dc853:kvwatch/requests/http1.py > /tmp/http1_before.py
  .venv/bin/python -m bench.http1_bench --baseline /tmp/http1_before.py
  .venv/bin/python -m bench.http1_bench --quick     # this checkout's http1.py against itself, tiny sizes

http1.py imports nothing of kvwatch, so the one file is the whole baseline.
"""

from __future__ import annotations

import timeit
from pathlib import Path
from types import ModuleType

from bench._harness import load_module, parser
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
    p = parser(__doc__)
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout's kvwatch/requests/http1.py (default with --quick: this checkout's)",
    )
    p.add_argument("--number", type=int, default=200_000)
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    if args.quick:
        args.number, args.repeat = 2_000, 2
        args.baseline = args.baseline or Path(http1.__file__)
    if args.baseline is None:
        p.error("--baseline FILE is required (another checkout's kvwatch/requests/http1.py)")
    baseline = load_module(args.baseline, "http1_baseline")
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
