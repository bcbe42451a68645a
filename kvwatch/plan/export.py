"""A ledger as a Mooncake-style trace: one JSON line per request, no text.

``{"timestamp": <ms from the first request>, "input_length": <prompt tokens>, "output_length":
<output tokens>}``, in arrival order: the fields Mooncake's traces carry besides ``hash_ids``
(prefix-cache block hashes, which a ledger does not record). Replay it with AIPerf
(``aiperf profile --input-file trace.jsonl --custom-dataset-type mooncake_trace``) or with
vLLM's benchmark client (``vllm bench serve --dataset-name custom`` cannot time requests; see
docs/planning.md for which flag reads what). Truncated requests are exported with their budget as
output length; aborted ones with the tokens their client received (at least 1: both readers ask the
engine for ``output_length`` tokens), and with the prompt length the replay gives them where their
line had no usage (``plan.inputs``).
"""

from __future__ import annotations

import json
from pathlib import Path

from kvwatch.plan.inputs import Workload


def mooncake_lines(workload: Workload) -> list[str]:
    lines = []
    for r in workload.requests:
        received = workload.received_tokens.get(r.request_id)
        if received is not None:
            output = max(received, 1)
        else:
            output = min(r.output_tokens, r.max_tokens) if r.max_tokens is not None else r.output_tokens
        lines.append(
            json.dumps(
                {
                    "timestamp": round(r.arrival * 1000.0),
                    "input_length": r.prompt_tokens,
                    "output_length": int(output),
                },
                separators=(",", ":"),
            )
        )
    return lines


def export_mooncake(workload: Workload, path: str | Path) -> int:
    lines = mooncake_lines(workload)
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return len(lines)
