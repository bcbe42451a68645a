"""kvwatch's vLLM plugin: its cost per engine step, the agent's CPU per 10,000 datagrams, series per replica.

    .venv/bin/python -m bench.vllm_plugin_bench [--steps-log VLLM_LOG] [--quick]

1. Plugin cost: ``KvwatchStatLogger.record`` runs in the vLLM API server's output handler once per
   engine step. Timed in the real vLLM venv with vLLM's own stats classes (8 running requests, the
   iteration details, a finished request every 10th step), sending to a socket a thread drains (agent
   present) and to no socket (agent absent), against vLLM's own ``LoggingStatLogger.record`` (the
   peer, same call site) and the engine's step time: the median ``iteration elapsed time`` of a vLLM
   log written with ``--enable-logging-iteration-details`` (``--steps-log``), else 20 ms.
2. Agent CPU per 10,000 datagrams: decode + ``PluginStats.observe`` + ``RequestStats.observe``, against
   ``json.loads`` of the same bytes.
3. Series per replica: the exposition of one replica with and without plugin data in every band.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import textwrap
import time
from pathlib import Path

from bench._harness import load_module
from bench._harness import parser as bench_parser

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("VENV", Path.home() / ".cache" / "kvwatch-vllm" / "venv"))

IN_VLLM = textwrap.dedent("""
    import json, os, socket, sys, threading, time, logging
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import (FinishedRequestStats, IterationStats, PrefixCacheStats,
                                       SchedulerIterationDetails, SchedulerStats)
    from vllm.v1.metrics.loggers import LoggingStatLogger
    logging.getLogger("vllm").setLevel(logging.WARNING)  # the peer must not print a line per step
    path, absent, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); rx.bind(path)
    def drain():
        while True:
            try: rx.recv(70000)
            except OSError: return
    threading.Thread(target=drain, daemon=True).start()
    def stats(i):
        s = SchedulerStats(num_running_reqs=8, num_waiting_reqs=2, kv_cache_usage=0.8,
                           prefix_cache_stats=PrefixCacheStats(),
                           iteration_details=SchedulerIterationDetails(i, 0, 0, 8, 8, 20.0))
        it = IterationStats(); it.num_generation_tokens = 8
        if i % 10 == 0:
            it.finished_requests = [FinishedRequestStats(FinishReason.STOP, "id", 5.0, 900, 1, 700, 1000,
                                                         0.1, 0.2, 4.9, 4.7, 0.006, False, 128)]
        return s, it
    samples = [stats(i) for i in range(n)]
    out = {}
    from kvwatch_vllm_plugin.logger import KvwatchStatLogger
    for name, target in (("present", path), ("absent", absent)):
        os.environ["KVWATCH_VLLM_SOCKET"] = target
        logger = KvwatchStatLogger(None, 0)
        t0 = time.perf_counter()
        for s, it in samples:
            logger.record(s, it)
        out[name] = (time.perf_counter() - t0) / n
        out[name + "_dropped"] = logger.sender.dropped
    class Cfg: pass
    peer = LoggingStatLogger.__new__(LoggingStatLogger)
    try:
        from vllm.config import VllmConfig
        peer = LoggingStatLogger(VllmConfig(), 0)
        t0 = time.perf_counter()
        for s, it in samples:
            peer.record(s, it)
        out["vllm_logging_logger"] = (time.perf_counter() - t0) / n
    except Exception as exc:
        out["vllm_logging_logger"] = None; out["peer_error"] = repr(exc)[:200]
    print(json.dumps(out))
""")


def median_step_ms(log: Path | None) -> tuple[float, str]:
    if log is None or not log.exists():
        return 20.0, "assumed 20 ms (no --steps-log)"
    text = log.read_text(errors="replace")
    ms = [float(m) for m in re.findall(r"iteration elapsed time: ([\d.]+) ms", text)]
    if not ms:
        return 20.0, f"assumed 20 ms ({log} has no iteration lines)"
    return statistics.median(ms), f"median of {len(ms)} steps in {log.name}"


def plugin_cost(step_ms: float, steps: int) -> dict:
    tmp = Path(f"/tmp/kvwatch-plugin-bench-{os.getpid()}")
    tmp.mkdir(exist_ok=True)
    sock = tmp / "present.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "plugins" / "vllm"), "VLLM_TARGET_DEVICE": "cpu"}
    proc = subprocess.run(
        [str(VENV / "bin" / "python"), "-c", IN_VLLM, str(sock), str(tmp / "absent.sock"), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=True,
    )
    sock.unlink(missing_ok=True)
    tmp.rmdir()
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agent_cost(n: int = 10_000) -> dict:
    # the plugin's wire format, stdlib only: the agent side needs no vLLM to encode datagrams
    wire = load_module(
        ROOT / "plugins" / "vllm" / "kvwatch_vllm_plugin" / "wire.py", "kvwatch_vllm_plugin_wire"
    )

    from kvwatch.model import DEFAULT_BANDS
    from kvwatch.requests.vllm_plugin import decode
    from kvwatch.state import PluginStats, RequestStats

    finished = {
        "reason": "stop",
        "e2e": 5.0,
        "queue": 0.1,
        "prefill": 0.2,
        "decode": 4.7,
        "inference": 4.9,
        "prompt": 900,
        "output": 700,
        "cached": 128,
        "max_tokens": 1000,
        "preemptions": 1,
    }
    step = {
        "run": 8,
        "wait": 2,
        "kv": 0.8,
        "pc_req": 0,
        "pc_q": 0,
        "pc_h": 0,
        "pre_req": 0,
        "pre_q": 0,
        "pre_h": 0,
        "preempted": 0,
        "gen": 8,
        "pt_comp": 0,
        "pt_local": 0,
        "pt_ext": 0,
        "it": [0, 0, 8, 8, 20.0],
    }
    datagrams = [
        wire.dumps(
            wire.encode(
                {"v": 1, "e": 0, "p": 1, "n": i, "t": 1e9 + i, "d": 0},
                [step],
                [finished] if i % 10 == 0 else [],
                [],
                0,
            )[0]
        )
        for i in range(n)
    ]
    plugin, requests = PluginStats(), RequestStats(DEFAULT_BANDS)
    t0 = time.process_time()
    for d in datagrams:
        out = decode(d, "r0", "m")
        for step in out.steps:
            plugin.observe(out.link, step)
        for r in out.records:
            requests.observe(r)
    agent = time.process_time() - t0
    t0 = time.process_time()
    for d in datagrams:
        json.loads(d)
    loads = time.process_time() - t0
    return {"agent_cpu_s": agent, "json_loads_s": loads, "bytes": statistics.mean(len(d) for d in datagrams)}


def series_per_replica() -> dict:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvwatch.config import Config, ReplicaConfig, VllmPluginSocketConfig
    from kvwatch.export.plugin import PluginCollector
    from kvwatch.export.requests import RequestCollector
    from kvwatch.model import EngineStep, EvictionSample, Outcome, PluginLink, RequestRecord
    from kvwatch.state import BATCH_TOKEN_BANDS, NodeState

    def count(with_plugin: bool) -> int:
        cfg = Config(
            replicas=(ReplicaConfig("r0", "http://127.0.0.1:1/metrics", model_name="m"),),
            vllm_plugin_sockets=(VllmPluginSocketConfig("r0", "/run/kvwatch/r0.sock"),)
            if with_plugin
            else (),
        )
        state = NodeState("n", cfg.length_bands)
        if with_plugin:
            for out in (500, 3000, 7000, 15000, 25000):
                state.requests.observe(
                    RequestRecord(
                        "r0",
                        "m",
                        "vllm_plugin",
                        Outcome.COMPLETED,
                        0.0,
                        prompt_tokens=900,
                        output_tokens=out,
                        max_tokens=32000,
                        e2e_seconds=30.0,
                        queue_seconds=0.1,
                        prefill_seconds=0.2,
                        decode_seconds=29.0,
                        preemptions=1,
                        cached_prompt_tokens=100,
                    )
                )
            for tokens in (8, 32, 128, 512, 2000, 8000, 20000)[: len(BATCH_TOKEN_BANDS.names)]:
                state.plugin.observe(
                    PluginLink("r0", "0", 1, 1, 0),
                    EngineStep(
                        "r0",
                        "0",
                        0.0,
                        ctx_tokens=tokens,
                        gen_tokens=0,
                        elapsed_ms=10.0,
                        resumed_queried_tokens=0,
                        resumed_hit_tokens=0,
                        evictions=(EvictionSample(10.0, 1.0, (1.0,)),),
                    ),
                )
        registry = CollectorRegistry(auto_describe=False)
        for c in (RequestCollector(state, cfg), PluginCollector(state, cfg)):
            registry.register(c)
        return sum(1 for line in generate_latest(registry).decode().splitlines() if line and line[0] != "#")

    without, with_ = count(False), count(True)
    return {"without": without, "with": with_, "added": with_ - without}


def main() -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--steps-log", type=Path, help="a vLLM log with --enable-logging-iteration-details")
    parser.add_argument("--steps", type=int, default=20_000, help="record() calls to time")
    args = parser.parse_args()
    datagrams = 200 if args.quick else 10_000
    if args.quick:
        args.steps = 200
    step_ms, step_source = median_step_ms(args.steps_log)
    cost = plugin_cost(step_ms, args.steps)
    print(f"engine step: {step_ms:.2f} ms ({step_source})")
    for name in ("present", "absent"):
        us = cost[name] * 1e6
        share = us / 1000 / step_ms * 100
        print(
            f"plugin record(), agent {name}: {us:.1f} us per step = {share:.3f}% of a step"
            f" (dropped {cost[name + '_dropped']})"
        )
    if cost.get("vllm_logging_logger"):
        print(
            f"peer, vLLM's LoggingStatLogger.record: {cost['vllm_logging_logger'] * 1e6:.1f} us per step "
            f"(plugin / peer = {cost['present'] / cost['vllm_logging_logger']:.2f}x)"
        )
    else:
        print(f"peer not measured: {cost.get('peer_error')}")
    agent = agent_cost(datagrams)
    ratio = agent["agent_cpu_s"] / agent["json_loads_s"]
    print(
        f"agent: {agent['agent_cpu_s'] * 1000 * 10_000 / datagrams:.0f} ms CPU per 10,000 datagrams "
        f"({agent['bytes']:.0f} B "
        f"each, 1 in 10 with a finished request) = {ratio:.1f}x json.loads alone"
    )
    series = series_per_replica()
    print(
        f"series per replica (requests + plugin areas, traffic in every band): {series['without']} "
        f"without, {series['with']} with the plugin: {series['added']} added"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
