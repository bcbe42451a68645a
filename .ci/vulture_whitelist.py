"""Reviewed false positives of the dead-code check (vulture, configured in pyproject.toml [tool.vulture]).

vulture reads this file as more source: each line below "uses" a name vulture found no use of. Every
entry says why the name is alive. Names that a protocol or framework calls by name (asyncio protocol
callbacks, http.server's do_GET, pytest hooks, pynvml's nvmlDevice* calls that the fake mirrors) are
in [tool.vulture] ignore_names instead. Remove an entry when its name goes; add one only with a reason.
"""
# ruff: noqa
# fmt: off

# --- read by name, through getattr / dataclasses.fields / asdict
_.link_down_trained          # derive/tiers.py TierFlags field, read by name via export/derived.py TIER_CONDITIONS
_.fragmentation_note         # status/view.py field: the status JSON is asdict(view)
_.last_success_at            # status/view.py field: the status JSON is asdict(view)
_.live_tokens_estimate       # status/view.py field: the status JSON is asdict(view)
_.derived_at                 # status/view.py field: the status JSON is asdict(view)
_.prompt_tokens_p90          # report/summary.py BandRow column: ROW_COLUMNS = fields(BandRow) renders every field
_.prompt_tokens_p99          # report/summary.py BandRow column: ROW_COLUMNS = fields(BandRow) renders every field
_.kv_excluded_requests       # report/summary.py Summary field, written to the JSON report
_.e2e_p99                    # plan/compare.py Outcome field, the twin's JSON output (sim/loadgen.py fills the same key)

# --- set by kvwatch, read by a library
_.whitespace_split           # discovery/pods.py: shlex.shlex reads it while splitting a shell script
_.timestamp_ms               # export/protobuf.py: a field of client_model's Metric message, serialized by protobuf
_.latencyUsec                # gpu/fake.py: a field of pynvml's c_nvmlFieldValue_t, which the fake fills as NVML does
_.ullVal                     # gpu/fake.py: a member of pynvml's c_nvmlValue_t union, as NVML fills it
_.pre_tokenizer              # scripts/engines/vllm-cpu/make_tiny_model.py: tokenizers' Tokenizer property, saved with it
_.chat_template              # scripts/engines/vllm-cpu/make_tiny_model.py: transformers saves it into tokenizer_config.json

# --- signatures fixed by the caller
_.indentless                 # mixin/rulefile.py: PyYAML calls Dumper.increase_indent(flow=..., indentless=...) by keyword
_.__call__                   # requests/proxy/seams.py: a Protocol's call signature
_.vllm_config                # plugins/vllm logger.py: vLLM's StatLoggerBase.__init__ passes these by keyword
_.mm_cache_stats             # plugins/vllm logger.py: vLLM's StatLoggerBase.record() passes these by keyword
_.engine_idx                 # plugins/vllm logger.py: vLLM's StatLoggerBase.record() passes these by keyword
_.Get                        # tests/discovery/fake_kubelet.py: gRPC servicer method, called by name by grpcio
_.GetAllocatableResources    # tests/discovery/fake_kubelet.py: gRPC servicer method, called by name by grpcio
_.is_closing                 # tests/requests/test_proxy_relay_property.py: asyncio.Transport's method, on a stand-in transport
_.DataclassInstance          # status/view.py: imported under TYPE_CHECKING for a string annotation (TypeVar bound)

# --- mirrors of a foreign structure, kept field for field
_.num_generation_tokens      # tests/plugin/vllm_harness.py: set on vLLM's IterationStats; the plugin reads it via _get()
_.num_preempted_reqs         # tests/plugin/vllm_harness.py: set on vLLM's IterationStats; the plugin reads it via _get()
_.local_cache_hit            # tests/plugin/vllm_harness.py: set on vLLM's PromptTokenStats; the plugin reads it via _get()
_.num_running_reqs           # tests/plugin/vllm_harness.py: a property that raises, read by the plugin via _get()
_.client_port                # tests/requests/wire.py: a captured request's TCP source port, shown in failure messages
_.received_at                # tests/e2e/alerting.py: when Alertmanager's POST arrived, shown in failure messages

# --- documented vocabulary or constant, named in docstrings
_.TIERS                      # model.py: the tier words adapters translate engine names into
_.RELATIVE_ERROR             # native_histogram.py: the per-bucket error bound the module docstring quotes
_.COLUMNS                    # report/load.py: the request-table columns every loader produces (named in docstrings)

# --- simulator records and counters, kept for inspection of a run (the twin reads its own subset)
_.last_token_time            # sim/engine.py TokenEvent field
_.available_before           # sim/engine.py StepInfo: blocks allocatable when a step began
_.decode_block_demand        # sim/engine.py StepInfo: blocks the decode batch needed before preemption
_.offload_store_seconds      # sim/stats.py: time spent storing KV to host, beside the byte counters
_.offload_load_seconds       # sim/stats.py: time spent loading KV from host, beside the byte counters
_.gpu_memory_bytes           # sim/memory.py ReplicaMemory: the GPU size the plan was made for
_.usage_timeline             # plan/replay.py: thinned node KV usage over the replay; written, not yet read (see the twin work)

# --- proxy relay state
_.engine_usage               # requests/proxy/relay.py: set when the engine sends usage unasked; not read yet (proxy rework)
