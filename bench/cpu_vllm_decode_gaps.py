"""Mean decode step of a running vLLM at a few concurrencies: the TP=1 / TP=2 check of
docs/planning.md (run by bench/cpu_vllm_tp.sh, one engine at a time). Prints one JSON line.

The mean of a phase's chunk gaps is (last chunk - first chunk) / (chunks - 1) over its streams, so it
holds when the server coalesces tokens into bursts (at TP=2 the CPU vLLM streams several tokens back
to back, microseconds apart, so a median gap measures the burst, not the step)."""

from __future__ import annotations

import json
import statistics
import sys

from kvwatch.plan.sources import _decode_phase, _filler_words


def main(url: str, model: str = "tiny", repeats: int = 3) -> None:
    out: dict[str, list[float]] = {}
    for c in (1, 2, 4):
        medians = []
        for _ in range(repeats):
            gaps, _prompt = _decode_phase(url, model, c, _filler_words(48, c), 64, 120.0)
            if len(gaps) >= 3:
                medians.append(statistics.fmean(gaps))
        out[str(c)] = medians
    print(json.dumps({"url": url, "decode_step_s": out}))


if __name__ == "__main__":
    main(sys.argv[1])
