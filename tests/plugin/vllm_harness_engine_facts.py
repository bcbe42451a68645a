"""Run by the real vLLM venv's python (not pytest): what the plugin sends where vLLM could not count, or
counted something else than it seems. vLLM's own stats classes compute the values.

argv: SOCKET_PATH. Prints one JSON object with facts the plugin read from vLLM itself.
"""

import json
import os
import sys
import threading
import time
from types import SimpleNamespace

from vllm.config import CacheConfig
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, RequestStateStats, SchedulerStats

os.environ["KVWATCH_VLLM_SOCKET"] = sys.argv[1]
from kvwatch_vllm_plugin.logger import KvwatchStatLogger

try:
    from kvwatch_vllm_plugin.logger import prefix_stats_per_admission
except ImportError:  # a plugin before it (the test then shows what that one sends)

    def prefix_stats_per_admission():
        return None


def config(caching: bool, connector: bool = False, default_max_tokens=None):
    """A VllmConfig's parts the plugin reads: vLLM's CacheConfig; max_model_len and the generation
    config's defaults as ``ModelConfig.get_diff_sampling_param`` returns them."""
    diff = {} if default_max_tokens is None else {"max_tokens": default_max_tokens}
    return SimpleNamespace(
        cache_config=CacheConfig(enable_prefix_caching=caching),
        kv_transfer_config=SimpleNamespace(kv_connector="OffloadingConnector") if connector else None,
        model_config=SimpleNamespace(
            max_model_len=2048, override_generation_config={}, get_diff_sampling_param=lambda: diff
        ),
    )


def resumed_step(caching: bool, connector: bool) -> tuple[SchedulerStats, IterationStats]:
    """One step that admits a resumed request of 1000 tokens, as the scheduler records it
    (vllm/v1/core/sched/scheduler.py): the local cache had 400 (only counted with caching on), the
    connector was asked for the other 600 and had 500."""
    sched = SchedulerStats(num_running_reqs=1)  # prefix_cache_stats: vLLM's default, zeroed
    if caching:
        sched.prefix_cache_stats.record(num_tokens=1000, num_hits=400, preempted=True)
    if connector:
        sched.connector_prefix_cache_stats = PrefixCacheStats()
        sched.connector_prefix_cache_stats.record(
            num_tokens=1000 - (400 if caching else 0), num_hits=500, preempted=True
        )
    it = IterationStats()
    it.num_preempted_reqs = 1
    return sched, it


# prefix caching off (--no-enable-prefix-caching), no connector: vLLM counted nothing
off = KvwatchStatLogger(config(caching=False), engine_index=0)
off.record(*resumed_step(caching=False, connector=False))
off.flush()
# caching on with an OffloadingConnector, and off with one: the connector's lookup counts
with_connector = KvwatchStatLogger(config(caching=True, connector=True), engine_index=1)
with_connector.record(*resumed_step(caching=True, connector=True))
with_connector.flush()
connector_only = KvwatchStatLogger(config(caching=False, connector=True), engine_index=2)
connector_only.record(*resumed_step(caching=False, connector=True))
connector_only.flush()

# requests that finish without a token (FINISHED_ERROR) or before they were ever scheduled. The first
# as vLLM's OutputProcessor leaves it: update_from_output runs on the finishing output (no token)
# before update_from_finished_request, and stamps the first and last token there while prefilling
# (vllm/v1/metrics/stats.py); the second was never scheduled, its scheduled stamp stayed 0.0
errors = KvwatchStatLogger(config(caching=True), engine_index=3)
it = IterationStats()
now = time.monotonic()
failed = RequestStateStats(
    arrival_time=time.time() - 1.0,
    queued_ts=now - 0.9,
    scheduled_ts=now - 0.5,
    first_token_ts=now,  # update_from_output's stamps, token or not
    last_token_ts=now,
)
it.update_from_finished_request(FinishReason.ERROR, "SECRET-E1", 40, 64, failed)
it.update_from_finished_request(
    FinishReason.ABORT,
    "SECRET-E2",
    40,
    64,
    RequestStateStats(arrival_time=time.time() - 2.0, queued_ts=now - 1.9),
)
ok = RequestStateStats(
    arrival_time=time.time() - 1.0,
    queued_ts=now - 0.9,
    scheduled_ts=now - 0.8,
    first_token_ts=now - 0.5,
    last_token_ts=now - 0.1,
    num_generation_tokens=5,
)
it.update_from_finished_request(FinishReason.STOP, "SECRET-E3", 40, 64, ok)
negative = [(f.queued_time, f.prefill_time, f.inference_time) for f in it.finished_requests]
errors.record(SchedulerStats(), it)

# max_tokens as vLLM resolved it: the remaining context (a client without max_tokens), the generation
# config's default (idem), and a client's own 64
limits = KvwatchStatLogger(config(caching=True, default_max_tokens=512), engine_index=4)
it = IterationStats()
for max_tokens in (2048 - 40, 512, 64):
    it.update_from_finished_request(FinishReason.STOP, "SECRET-M", 40, max_tokens, ok)
limits.record(SchedulerStats(), it)

# a fork while another thread of the parent holds the sender's drain lock: the child must still send,
# under its own pid (vLLM and its users fork; the thread that held the lock does not exist there)
forking = KvwatchStatLogger(config(caching=True), engine_index=5)
taken, release = threading.Event(), threading.Event()


def hold_the_lock() -> None:
    with forking.sender._lock:
        taken.set()
        release.wait(10)


holder = threading.Thread(target=hold_the_lock)
holder.start()
taken.wait(10)
child = os.fork()
if child == 0:
    forking.record(SchedulerStats(), IterationStats())
    forking.flush()
    os._exit(0 if forking.sender.sent == 1 else 3)
release.set()
holder.join()
_, status = os.waitpid(child, 0)


class KVCacheManagerBefore027(KVCacheManager):
    """vLLM 0.26.0's shape: no record_prefix_cache_stats (get_computed_blocks recorded each lookup)."""

    record_prefix_cache_stats = None


print(
    json.dumps(
        {
            "per_admission_before_027": prefix_stats_per_admission(KVCacheManagerBefore027)
            if prefix_stats_per_admission.__code__.co_argcount
            else None,
            "negative": negative,
            "child": child,
            "child_status": os.waitstatus_to_exitcode(status),
            "per_admission": prefix_stats_per_admission(),
            "installed_has_recorder": hasattr(KVCacheManager, "record_prefix_cache_stats"),
            "failures": sum(x.failures for x in (off, with_connector, connector_only, errors, limits)),
        }
    )
)
