"""A realistic node for status tests: samples and records built directly, derived view by the real code.

Two vLLM replicas of one model on two H200s (r0 behind the kvwatch proxy, queueing and preempting;
r1 idle with free KV) and one SGLang replica whose scrapes fail. Two engine scrapes 10 s apart feed
``kvwatch.agent.derived.update_derived``, so headroom, preemption rates, stranded capacity and PCIe rates
are what the agent itself would compute.
"""

from __future__ import annotations

from dataclasses import replace

from kvwatch.agent.derived import update_derived
from kvwatch.config import Config, config_from_mapping
from kvwatch.model import GpuSample, InFlightRequest, Outcome, ReplicaSample, RequestRecord
from kvwatch.state import NodeState

T0 = 1_750_000_000.0
MODEL = "qwen3-32b"
GIB = 2**30


def config() -> Config:
    return config_from_mapping(
        {
            "node": "gpu-node-7",
            "replicas": [
                {
                    "name": "r0",
                    "backend": "vllm",
                    "metrics_url": "http://127.0.0.1:8000/metrics",
                    "api_url": "http://127.0.0.1:8000",
                    "proxy_listen": "127.0.0.1:0",
                    "model_name": MODEL,
                },
                {
                    "name": "r1",
                    "backend": "vllm",
                    "metrics_url": "http://127.0.0.1:8001/metrics",
                    "model_name": MODEL,
                },
                {"name": "s0", "backend": "sglang", "metrics_url": "http://127.0.0.1:30000/metrics"},
            ],
        }
    )


def vllm_sample(
    replica: str,
    at: float,
    usage: float,
    running: float,
    waiting: float,
    preemptions: float,
    generated: float,
    prompt: float,
    finished: float,
) -> ReplicaSample:
    return ReplicaSample(
        replica=replica,
        backend="vllm",
        scraped_at=at,
        model_name=MODEL,
        dp_rank=None,
        block_size=16,
        num_gpu_blocks=20001,
        kv_usage_ratio=usage,
        requests_running=running,
        requests_waiting=waiting,
        preemptions_total=preemptions,
        generation_tokens_total=generated,
        prompt_tokens_total=prompt,
        finished_requests_total=(("stop", finished),),
    )


def gpu(index: int, at: float, tx: float, rx: float, used_gib: float) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}0000000-aaaa",
        name="NVIDIA H200",
        sampled_at=at,
        memory_total_bytes=141 * GIB,
        memory_used_bytes=used_gib * GIB,
        utilization_gpu_ratio=0.9 if index == 0 else 0.1,
        pcie_tx_bytes_total=tx,
        pcie_rx_bytes_total=rx,
        pcie_link_gen_current=5,
        pcie_link_gen_max=5,
        pcie_link_width_current=16,
        pcie_link_width_max=16,
    )


def records() -> list[RequestRecord]:
    out = []
    for i in range(40):
        output = [300, 2500, 7000, 15000][i % 4]
        ttft = 0.2 + 0.05 * (i % 5)
        e2e = ttft + 0.03 * output
        outcome = Outcome.TRUNCATED if i % 10 == 9 else Outcome.COMPLETED
        out.append(
            RequestRecord(
                "r0",
                MODEL,
                "proxy",
                outcome,
                T0 - 100 + i,
                endpoint="chat",
                streaming=True,
                status_code=200,
                prompt_tokens=800,
                output_tokens=output,
                max_tokens=16000,
                ttft_seconds=ttft,
                e2e_seconds=e2e,
            )
        )
    out.append(RequestRecord("r0", MODEL, "proxy", Outcome.ERROR, T0 - 5, status_code=502))
    out.append(
        RequestRecord(
            "r1",
            MODEL,
            "otlp",
            Outcome.COMPLETED,
            T0 - 50,
            prompt_tokens=100,
            output_tokens=500,
            ttft_seconds=0.1,
            e2e_seconds=5.1,
        )
    )
    return out


def populated_state(step: int = 0) -> tuple[NodeState, Config]:
    """The node after two scrapes (at T0 and T0 + 10); ``step`` > 0 moves r0's KV usage up."""
    cfg = config()
    state = NodeState(cfg.node, cfg.length_bands)
    state.started_at = T0 - 3600
    for rec in records():
        state.requests.observe(rec)
    for i in range(26):  # r0 runs 26 requests, all relayed by the proxy
        handle = state.in_flight.start(InFlightRequest("r0", MODEL, "20k+", 800, 0, T0 - 30 + i, 32000))
        state.in_flight.progress(handle, 3000 + 100 * i)
    state.replica_gpus = {
        "r0": (("0", "GPU-00000000-aaaa", "config"),),
        "r1": (("1", "GPU-10000000-aaaa", "config"),),
    }
    scrapes = [
        (
            T0,
            {"r0": (0.60, 24, 3, 10, 1_000_000, 400_000, 500), "r1": (0.10, 2, 0, 0, 50_000, 9_000, 90)},
            (1e12, 2e12),
        ),
        (
            T0 + 10,
            {
                "r0": (0.70 + 0.1 * step, 26, 5, 12, 1_006_000, 402_000, 505),
                "r1": (0.10, 2, 0, 0, 50_400, 9_100, 91),
            },
            (1e12 + 5e10, 2e12 + 1e10),
        ),
    ]
    for at, replicas, (tx, rx) in scrapes:
        for name, values in replicas.items():
            target = state.target(name)
            target.backend, target.up, target.last_success_ts = "vllm", True, at
            target.samples = (vllm_sample(name, at, *values),)
            target.in_flight = tuple(state.in_flight.current(name))  # as the scraper reads a page
        failing = state.target("s0")
        failing.backend, failing.up = "sglang", False
        failing.last_error = "connect: connection refused (http://127.0.0.1:30000/metrics)"
        state.gpus = (gpu(0, at, tx, rx, 120), gpu(1, at, tx / 100, rx / 100, 60))
        update_derived(state, cfg, at)
    return state, cfg


def with_usage(state: NodeState, cfg: Config, replica: str, usage: float) -> None:
    """Replace a replica's sample with one at a new KV usage and derive again (what the next scrape
    job does: it writes the samples, then ``update_derived``)."""
    target = state.target(replica)
    target.samples = (replace(target.samples[0], kv_usage_ratio=usage),)
    update_derived(state, cfg, target.samples[0].scraped_at)
