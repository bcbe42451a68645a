"""The proxy's live-token estimate in ``kvwatch demo`` against the simulator's own count.

Runs the demo's node (8 simulated vLLM replicas behind kvwatch's proxies, the real agent) for
``--seconds`` wall seconds. Each time a replica's ``/metrics`` page is rendered, the simulator's own
count of the KV tokens its running requests hold is kept, split into prompt and generated tokens;
twice a second the agent's derived view is read, and each proxy estimate (``live_source
proxy_estimate``) is compared with the count of the page it was derived from. The replica the demo
overloads (``replica-0``, preempting: re-prefilling requests hold less than they will) is left out.

Prints, over all readings, the error of the estimate as a share of the true live tokens (p10 / p50 /
p90), the same for its prompt and generated parts (the proxy's in-flight snapshot of each page,
``TargetState.in_flight``), and how many readings had no estimate or no fragmentation ratio.

  .venv/bin/python -m bench.live_tokens_demo [--seconds 40] [--quick]
  PYTHONPATH=/tmp/base .venv/bin/python bench/live_tokens_demo.py    # another checkout's kvwatch
"""

from __future__ import annotations

import asyncio
from collections import Counter

import kvwatch.sim.server as sim_server
from bench._harness import parser, percentile
from kvwatch.config import parse_host_port
from kvwatch.demo import DemoNode, DemoSettings
from kvwatch.derive.fragmentation import running_requests
from kvwatch.sim.engine import SimEngine

#: the simulator's states whose requests hold KV
HOLDING = ("prefill", "decode")


class PageTruth:
    """The simulator's count at each page render: (prompt, generated, all) KV tokens per replica."""

    def __init__(self) -> None:
        self.at_page: dict[int, tuple[int, int, int]] = {}
        self._render = sim_server.render_vllm_metrics

    def install(self) -> None:
        def render(engines: list[SimEngine], *args, **kwargs) -> str:
            views = [v for e in engines for v in e.requests() if v.state in HOLDING]
            kv = sum(v.kv_tokens for v in views)
            prompt = sum(min(v.prompt_tokens, v.kv_tokens) for v in views)
            self.at_page[id(engines[0])] = (prompt, kv - prompt, kv)
            return self._render(engines, *args, **kwargs)

        sim_server.render_vllm_metrics = render


async def measure(seconds: float) -> tuple[dict[str, list[float]], Counter[str]]:
    truth = PageTruth()
    truth.install()
    demo = DemoNode(DemoSettings(listen=parse_host_port("127.0.0.1:0")))
    await demo.start()
    assert demo.agent is not None
    state = demo.agent.state
    engine_of = {f"replica-{i}": id(e) for i, e in enumerate(demo.node.engines)}
    errors: dict[str, list[float]] = {"live": [], "prompt": [], "generated": []}
    notes: Counter[str] = Counter()

    def read() -> None:
        for frag in state.derived.fragmentation:
            page = truth.at_page.get(engine_of.get(frag.replica, 0))
            target = state.targets.get(frag.replica)
            if frag.replica == "replica-0" or page is None or not page[2] or target is None:
                continue
            notes[frag.note or "estimated"] += 1
            if frag.live_tokens is None:
                continue
            errors["live"].append((frag.live_tokens - page[2]) / page[2])
            in_flight = getattr(target, "in_flight", None)  # None: a checkout from before 7219a28
            if in_flight is not None:
                held = running_requests(in_flight, target.samples[0].requests_running)
                prompt = sum(r.prompt_tokens_estimate for r in held)
                errors["prompt"].append((prompt - page[0]) / page[2])
                errors["generated"].append((sum(r.generated_tokens for r in held) - page[1]) / page[2])

    async def sample() -> None:
        while True:
            await asyncio.sleep(0.5)
            read()

    sampler = asyncio.create_task(sample())
    try:
        await demo.run(seconds)
    finally:
        sampler.cancel()
        await demo.stop()
    return errors, notes


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--seconds", type=float, default=40.0, help="wall seconds of the demo (default 40)")
    args = p.parse_args(argv)
    seconds = 8.0 if args.quick else args.seconds
    errors, notes = asyncio.run(measure(seconds))
    print(f"kvwatch demo, {seconds:g} s wall; error as a share of the true live tokens, replicas 1-7")
    print("| part | readings | p10 | p50 | p90 |")
    print("|---|---|---|---|---|")
    for key, values in errors.items():
        if values:
            q = [f"{percentile(values, p) * 100:+.2f}%" for p in (10, 50, 90)]
            print(f"| {key} | {len(values)} | {' | '.join(q)} |")
    print("readings by outcome: " + "; ".join(f"{k}: {v}" for k, v in notes.most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
