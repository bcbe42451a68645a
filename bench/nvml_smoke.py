"""NVML smoke test for a real GPU machine: every call kvwatch makes, on every GPU, with latency.

Runs kvwatch's own code (``NvmlCollector.start/poll/process_gpus`` and ``XidWatcher``) against the
NVML module wrapped in a tracer, so the table lists exactly the calls kvwatch makes, not a
hand-kept copy: call -> how many times, outcome per error type, median/max latency, a sample value.
Then it times full ``poll()`` runs against a minimal peer poll measured in the same run (memory +
utilization per GPU, what the thinnest exporter does) and prints the ratio.

Exit status 0 whatever NVML answers (NOT_SUPPORTED is a finding, not a failure). On a machine
without a driver it prints one "no NVML library" line and exits 0.

  .venv/bin/python -m bench.nvml_smoke                 # the real driver (pynvml from nvidia-ml-py)
  .venv/bin/python -m bench.nvml_smoke --fake 8        # the fake H200 backend, to see the output
  .venv/bin/python -m bench.nvml_smoke --polls 50 --json /tmp/nvml.json
"""

from __future__ import annotations

import contextlib
import json
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench._harness import parser as bench_parser
from kvwatch.gpu.events import XidWatcher, handle_key
from kvwatch.gpu.nvml import NvmlCollector


class TracingNvml:
    """The NVML module with every ``nvml*`` function timed and its outcome recorded."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._gpu_of: dict[Any, int] = {}
        self.records: list[tuple[str, int | None, str, float, str]] = []  # call, gpu, outcome, us, value

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._module, name)
        if name.startswith("nvml") and callable(attr) and not isinstance(attr, type):
            return self._traced(name, attr)
        return attr

    def _traced(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            gpu = self._gpu(args[0]) if args else None
            started = time.perf_counter_ns()
            try:
                result = fn(*args, **kwargs)
            except Exception as exc:
                elapsed = (time.perf_counter_ns() - started) / 1000
                self.records.append((name, gpu, type(exc).__name__.removeprefix("NVMLError_"), elapsed, ""))
                raise
            elapsed = (time.perf_counter_ns() - started) / 1000
            if name == "nvmlDeviceGetHandleByIndex":
                self._gpu_of[handle_key(result)] = args[0]
                gpu = args[0]
            self.records.append((name + _variant(kwargs), gpu, "ok", elapsed, _summary(result)))
            return result

        return call

    def _gpu(self, first_arg: Any) -> int | None:
        try:
            return self._gpu_of.get(handle_key(first_arg))
        except TypeError:
            return None


def _variant(kwargs: dict[str, Any]) -> str:
    return "(version=v2)" if "version" in kwargs else ""


def _summary(value: Any, limit: int = 70) -> str:
    if hasattr(value, "_fields_"):
        text = ", ".join(f"{f}={getattr(value, f)}" for f, *_ in value._fields_ if f != "version")
    elif hasattr(value, "_length_") and len(value) and hasattr(value[0], "nvmlReturn"):
        text = " ".join(
            f"{fv.fieldId}/{fv.scopeId}:{'ok' if fv.nvmlReturn == 0 else fv.nvmlReturn}" for fv in value
        )
    elif isinstance(value, list):
        first = f": {vars(value[0])}" if value and hasattr(value[0], "__dict__") else ""
        text = f"{len(value)} item(s){first}"
    else:
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def print_table(records: list[tuple[str, int | None, str, float, str]]) -> None:
    by_call: dict[str, list[tuple[int | None, str, float, str]]] = defaultdict(list)
    for call, gpu, outcome, us, value in records:
        by_call[call].append((gpu, outcome, us, value))
    print(f"{'call':58} {'n':>4} {'outcomes':28} {'p50 us':>8} {'max us':>8}  sample")
    for call, rows in by_call.items():
        outcomes: dict[str, int] = defaultdict(int)
        for _, outcome, _, _ in rows:
            outcomes[outcome] += 1
        text = " ".join(f"{k}={v}" for k, v in sorted(outcomes.items()))
        latencies = [us for _, _, us, _ in rows]
        sample = next((v for _, o, _, v in rows if o == "ok" and v), "")
        print(
            f"{call:58} {len(rows):>4} {text:28} {statistics.median(latencies):>8.1f} "
            f"{max(latencies):>8.1f}  {sample}"
        )


def time_polls(module: Any, polls: int) -> dict[str, float]:
    """Full kvwatch polls vs a minimal peer poll (memory + utilization per GPU), same run."""
    collector = NvmlCollector(module)
    if not collector.start():
        return {}
    collector.poll()  # warm: link counts, NVLink field choice, handles
    handles = [module.nvmlDeviceGetHandleByIndex(i) for i in range(module.nvmlDeviceGetCount())]

    def peer() -> None:
        for h in handles:
            for call in (module.nvmlDeviceGetMemoryInfo, module.nvmlDeviceGetUtilizationRates):
                with contextlib.suppress(module.NVMLError):
                    call(h)

    def measure(fn: Callable[[], Any]) -> list[float]:
        out = []
        for _ in range(polls):
            started = time.perf_counter()
            fn()
            out.append((time.perf_counter() - started) * 1000)
        return out

    kvwatch_ms, peer_ms = measure(collector.poll), measure(peer)
    collector.stop()
    result = {
        "gpus": len(handles),
        "kvwatch_poll_ms_median": statistics.median(kvwatch_ms),
        "kvwatch_poll_ms_max": max(kvwatch_ms),
        "peer_poll_ms_median": statistics.median(peer_ms),
    }
    result["ratio_kvwatch_to_peer"] = result["kvwatch_poll_ms_median"] / max(
        result["peer_poll_ms_median"], 1e-9
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--fake", type=int, metavar="GPUS", help="use the fake backend with GPUS GPUs")
    parser.add_argument("--polls", type=int, default=20, help="timed polls (default 20)")
    parser.add_argument("--events-seconds", type=float, default=1.0, help="XID watcher run time")
    parser.add_argument("--json", type=Path, help="also write the timings and the call table here")
    args = parser.parse_args(argv)
    if args.quick:
        args.polls, args.events_seconds = 2, 0.1
    # quiet until NVML is up: without it the one line below says everything
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    if args.fake:
        from kvwatch.gpu.fake import FakeNvml

        module: Any = FakeNvml(args.fake)
    else:
        import pynvml as module

    traced = TracingNvml(module)
    collector = NvmlCollector(traced)
    if not collector.start():
        print(f"no NVML library or no GPU: {collector.report.error}")
        return 0
    logging.getLogger().setLevel(logging.WARNING)
    print(f"driver {collector.driver_version()}, backend {'fake' if args.fake else 'pynvml'}")
    samples = collector.poll()
    collector.process_gpus()
    xids: list[tuple[int, str, int]] = []
    watcher = XidWatcher(lambda i, u, x: xids.append((i, u, x)), nvml=traced)
    registered = {}
    if watcher.start():
        registered = dict(watcher.registered)
        time.sleep(args.events_seconds)
        watcher.stop()
    collector.stop()
    print_table(traced.records)
    print(f"\npoll report: {collector.report}")
    print(f"events registered: {registered or 'none'}; XIDs seen: {xids or 'none'}")
    for s in samples:
        missing = [k for k, v in vars_of(s).items() if v is None]
        print(f"GPU {s.index} {s.uuid} {s.name} lost={s.lost}; not available: {', '.join(missing) or 'none'}")

    timings = time_polls(module, args.polls)
    if timings:
        print(
            f"\nfull poll of {timings['gpus']} GPU(s): median {timings['kvwatch_poll_ms_median']:.2f} ms "
            f"(max {timings['kvwatch_poll_ms_max']:.2f} ms); peer (memory+utilization only) "
            f"{timings['peer_poll_ms_median']:.3f} ms; ratio {timings['ratio_kvwatch_to_peer']:.1f}x"
        )
    if args.json:
        args.json.write_text(json.dumps({"timings": timings, "calls": traced.records}, indent=1))
    return 0


def vars_of(sample: Any) -> dict[str, Any]:
    return {name: getattr(sample, name) for name in sample.__slots__}


if __name__ == "__main__":
    sys.exit(main())
