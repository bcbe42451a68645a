"""Records as engines and clients write them: the valid starting points that the property tests of
outside input (``tests/test_outsider_records_property.py``) make hostile one value at a time, and
that the hand-written hostile cases (``tests/requests/test_absurd_counts.py``) change in one place."""

from __future__ import annotations

import json

SGLANG_LINE = {
    "rid": "a1",
    "meta_info": {
        "completion_tokens": 40,
        "prompt_tokens": 4,
        "e2e_latency": 1.5,
        "queue_time": 0.01,
        "decode_throughput": 30.0,
        "request_received_ts": 1.7e9,
        "finish_reason": {"type": "length", "length": 40},
    },
    "request_parameters": json.dumps({"sampling_params": {"max_new_tokens": 40}}),
}

PLUGIN_DATAGRAM = {
    "v": 1,
    "e": 0,
    "t": 1.7e9,
    "p": 1,
    "n": 1,
    "d": 0,
    "s": [{"run": 2, "wait": 0, "kv": 0.5, "it": [1, 64, 1, 1, 2.0]}],
    "f": [
        {
            "reason": "stop",
            "prompt": 3,
            "output": 12,
            "preemptions": 0,
            "e2e": 1.0,
            "decode": 0.5,
            "ttft": 0.2,
        }
    ],
}

CHAT_REQUEST = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "max_tokens": 64,
    "stream_options": {"include_usage": False, "continuous_usage_stats": False},
    "n": 1,
}

USAGE_CHUNK = {
    "id": "c1",
    "object": "chat.completion.chunk",
    "choices": [],
    "usage": {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15},
    "system_fingerprint": "fp",
}

CHAT_RESPONSE = {
    "id": "c1",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15},
}
