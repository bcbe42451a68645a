"""The engine's own counters and histograms, kept in vLLM's shape (names, buckets, semantics).

Bucket lists are vLLM's verbatim (``vllm/v1/metrics/buckets.py``).
Histograms are plain arrays: one ``observe`` is a bisect and three additions, and a whole decode
batch that shares one inter-token gap is a single weighted observation.
"""

from __future__ import annotations

from kvwatch.buckets import Histogram

# packed by hand: one bound per line would hide the shape of the table
# fmt: off
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
TIME_TO_FIRST_TOKEN_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)
ITERATION_TOKENS_BUCKETS: tuple[float, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)
# fmt: on
REQUEST_PARAMS_N_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS: tuple[float, ...] = (1, 2, 3, 4, 5, 10, 20)
KV_OFFLOAD_SIZE_BUCKETS: tuple[float, ...] = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

#: vLLM's ``FinishReason`` strings, all pre-created at 0 in ``vllm:request_success_total``.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class EngineStats:
    """Everything one engine (one DP rank) counts, as vLLM's Prometheus stat logger would.

    Client aborts are not in ``success`` nor in the request histograms: vLLM's frontend
    ``OutputProcessor.abort_requests`` drops the request state without recording finished-request
    stats (read in vLLM 0.32). ``aborted`` keeps the simulator's own count.
    """

    def __init__(self, max_model_len: int) -> None:
        tokens = request_tokens_buckets(max_model_len)
        self.prompt_tokens = 0
        self.prompt_tokens_cached = 0  # local prefix-cache hits at first admission
        self.generation_tokens = 0
        self.preemptions = 0
        self.recomputed_tokens = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.external_queries = 0  # offload-tier lookups of resumed requests
        self.external_hits = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.aborted = 0
        self.offload_store_bytes = 0.0
        self.offload_store_seconds = 0.0
        self.offload_load_bytes = 0.0
        self.offload_load_seconds = 0.0
        self.offload_queue_seconds = 0.0  # steps' wait for host links beyond their own transfer time
        self.busy_seconds = 0.0  # simulated time spent inside steps
        self.steps = 0
        self.h_prompt_tokens = Histogram(tokens)
        self.h_generation_tokens = Histogram(tokens)
        self.h_max_num_generation_tokens = Histogram(tokens)
        self.h_params_max_tokens = Histogram(tokens)
        self.h_prefill_kv_computed = Histogram(tokens)
        self.h_params_n = Histogram(REQUEST_PARAMS_N_BUCKETS)
        self.h_iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.h_ttft = Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.h_itl = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.h_tpot = Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.h_e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.h_num_preemptions = Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.h_offload_store_size = Histogram(KV_OFFLOAD_SIZE_BUCKETS)
        self.h_offload_load_size = Histogram(KV_OFFLOAD_SIZE_BUCKETS)
