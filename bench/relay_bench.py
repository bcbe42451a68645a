"""CPU per relayed chunk of the proxy's exchange (on_body + flush, as an engine read drives it):
this checkout against a baseline checkout, each measured in a process of its own that imports that
checkout's kvwatch (the proxy and everything under it: accounting, SSE, HTTP/1, in-flight state),
interleaved (the order alternating each repeat), best of several repeats. No sockets: the client
side is a transport that counts what is written, so the figure is kvwatch's own Python per chunk
(de-chunked data in, framed bytes out, the meter, the in-flight update), without the syscalls and
loop that bench/proxy_bench.py also counts. Both sides must write the same bytes and meter the same
chunks, or the bench stops: a baseline that did less would look faster.

  git worktree add --detach /tmp/base 3b6fc93        # or: git archive 3b6fc93 | tar -x -C /tmp/base
  .venv/bin/python -m bench.relay_bench --baseline /tmp/base [--repeat N]
  .venv/bin/python -m bench.relay_bench --quick      # this checkout against itself, tiny sizes

The measurement itself is bench/_relay_child.py (a checkout from 3b6fc93, the one-module proxy, on).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench._harness import parser

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().parent / "_relay_child.py"


def measure(tree: Path, chunks: int, streams: int) -> dict[str, Any]:
    """One child process on ``tree``'s kvwatch (first on PYTHONPATH; the child's own folder holds no
    kvwatch, so nothing of this checkout shadows the baseline's)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(
        [sys.executable, str(CHILD), str(chunks), str(streams)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"relay_bench on {tree} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if not Path(result["kvwatch"]).resolve().is_relative_to(tree):
        raise SystemExit(f"the child for {tree} imported kvwatch from {result['kvwatch']}")
    return result


def main() -> None:
    p = parser(__doc__)
    p.add_argument(
        "--baseline",
        type=Path,
        help="another checkout (git worktree or git archive) to compare with (default with --quick: "
        "this checkout)",
    )
    p.add_argument("--chunks", type=int, default=2000, help="chunks per stream")
    p.add_argument("--streams", type=int, default=20, help="streams per repeat")
    p.add_argument("--repeat", type=int, default=7)
    args = p.parse_args()
    if args.quick:
        args.chunks, args.streams, args.repeat = 200, 2, 2
        args.baseline = args.baseline or ROOT
    if args.baseline is None:
        p.error("--baseline DIR is required (a checkout of the code to compare with)")
    trees = {"baseline": args.baseline.resolve(), "this checkout": ROOT}
    if not (trees["baseline"] / "kvwatch" / "__init__.py").exists():
        p.error(f"--baseline {args.baseline}: not a checkout (no kvwatch/__init__.py)")
    best = {name: float("inf") for name in trees}
    seen: dict[str, tuple[Any, Any]] = {}
    for i in range(args.repeat):
        order = list(trees.items())
        for name, tree in order[::-1] if i % 2 else order:  # neither always runs first
            result = measure(tree, args.chunks, args.streams)
            best[name] = min(best[name], result["ns_per_chunk"])
            seen[name] = (result["bytes_per_stream"], result["metered_chunks_per_stream"])
    if seen["baseline"] != seen["this checkout"]:
        raise SystemExit(
            f"the two sides did different work (bytes written per stream, chunks metered): {seen}"
        )
    print("| per relayed chunk (on_body + flush) | baseline | this checkout | ratio |")
    print("|---|---|---|---|")
    print(
        f"| vLLM chat chunk, one per read, metered, usage asked | {best['baseline']:,.0f} ns | "
        f"{best['this checkout']:,.0f} ns | {best['this checkout'] / best['baseline']:.2f} |"
    )


if __name__ == "__main__":
    main()
