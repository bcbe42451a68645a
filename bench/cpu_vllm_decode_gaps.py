"""Mean decode step of a running vLLM at a few concurrencies: the TP=1 / TP=2 check of
docs/planning.md (run by bench/cpu_vllm_tp.sh, one engine at a time). Prints one JSON line.

    .venv/bin/python -m bench.cpu_vllm_decode_gaps URL        # a running vLLM serving model "tiny"
    .venv/bin/python -m bench.cpu_vllm_decode_gaps --quick    # kvwatch's simulated vLLM in this process

Each figure is the step ``kvwatch plan calibrate --load`` observes with all ``c`` streams decoding
(``decode_observations``): time over tokens gained, so it holds when the server coalesces tokens into
bursts (at TP=2 the CPU vLLM streams several tokens back to back, microseconds apart, so a median
gap measures the burst, not the step)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

from bench._harness import parser
from kvwatch.plan.sources import decode_observations, decode_phase, filler_prompts
from kvwatch.sim.engine import EngineConfig
from kvwatch.sim.models import model_preset
from kvwatch.sim.node import NodeConfig, SimNode, serving_in_thread

MODEL = "tiny"


def main(url: str, model: str = MODEL, repeats: int = 3, concurrencies: tuple[int, ...] = (1, 2, 4)) -> None:
    out: dict[str, list[float]] = {}
    for c in concurrencies:
        steps = []
        for _ in range(repeats):
            streams = decode_phase(url, model, c, filler_prompts(48, c), 64, 120.0)
            steps += [o.seconds for o in decode_observations(streams) if o.decode_seqs == c]
        out[str(c)] = steps
    print(json.dumps({"url": url, "decode_step_s": out}))


@contextlib.contextmanager
def simulated_vllm() -> Iterator[str]:
    """kvwatch's simulated vLLM replica (its OpenAI API, served as ``tiny``); the base URL."""
    engine = EngineConfig(model=model_preset("llama-3.1-8b"), max_model_len=4000, max_num_seqs=16)
    node = SimNode(NodeConfig(engine=engine, replicas=1, speed=5.0, tick_s=0.01, served_model_name=MODEL))
    with serving_in_thread(node) as urls:
        yield urls[0]


if __name__ == "__main__":
    p = parser(__doc__)
    p.add_argument("url", nargs="?", help="the engine's base URL (default with --quick: a simulated one)")
    args = p.parse_args()
    if args.url:
        main(args.url, repeats=1 if args.quick else 3)
    elif args.quick:
        with simulated_vllm() as url:
            main(url, repeats=1, concurrencies=(1, 2))
    else:
        p.error("give the URL of a running vLLM (or --quick)")
