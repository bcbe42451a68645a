"""``plan calibrate --prometheus --tp-label``: one fit per TP degree, read from a real Prometheus.

Two simulated vLLM engines (the simulator's own vLLM exposition writer, served over HTTP) run in
real time with known step costs, one standing for a TP=1 engine and one for TP=2 (every cost
halved). A real Prometheus scrapes both each second; its scrape config gives each target a ``tp``
label, as a deployment would. The calibration must come out with one fit per degree, each from its
own engine's windows.
"""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvwatch.plan.calibration import EngineShape
from kvwatch.plan.fit import fits_by_tp
from kvwatch.plan.prometheus import observations_from_prometheus
from kvwatch.sim.engine import EngineConfig, SimEngine
from kvwatch.sim.exposition_writer import render_vllm_metrics
from kvwatch.sim.steptime import StepCost
from tests.local import free_port
from tests.plan.helpers import TINY

from .stack import Prometheus, wait_until

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

TP1 = StepCost(overhead_s=0.010, per_prefill_token_s=40e-6, per_decode_seq_s=0.004)
TP2 = StepCost(overhead_s=0.005, per_prefill_token_s=20e-6, per_decode_seq_s=0.002)


class _Engine:
    """A simulated engine kept at wall-clock time in a thread, fed a steady trickle of requests."""

    def __init__(self, cost: StepCost, seed: int) -> None:
        self.engine = SimEngine(
            EngineConfig(
                model=TINY,
                block_size=16,
                num_gpu_blocks_override=400,
                max_num_seqs=8,
                max_num_batched_tokens=2048,
                max_model_len=1024,
                step_cost=cost,
            )
        )
        self.lock = threading.Lock()
        self.seed = seed
        self.stop = threading.Event()

    def run(self) -> None:
        start, n = time.monotonic(), 0
        while not self.stop.is_set():
            now = time.monotonic() - start
            with self.lock:
                if self.engine.in_system < 6:
                    size = 40 + (n * 37 + self.seed) % 300
                    self.engine.submit(f"r{n}", size, 60 + n % 90, 60 + n % 90, arrival=now)
                    n += 1
                self.engine.advance_to(now)
            time.sleep(0.02)

    def page(self) -> bytes:
        with self.lock:
            return render_vllm_metrics([self.engine], "tiny", created=0.0)


def _serve(engine: _Engine) -> tuple[ThreadingHTTPServer, int]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = engine.page()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, port


def test_prometheus_calibration_fits_each_tp_degree_apart(tmp_path):
    engines = {1: _Engine(TP1, 1), 2: _Engine(TP2, 2)}
    servers, threads, scrape = [], [], []
    for tp, e in engines.items():
        server, port = _serve(e)
        servers.append(server)
        thread = threading.Thread(target=e.run, daemon=True)
        thread.start()
        threads.append(thread)
        scrape.append({"targets": [f"127.0.0.1:{port}"], "labels": {"tp": str(tp)}})
    prom = Prometheus(
        tmp_path, [], rule_files=(), extra_scrape_configs=[{"job_name": "vllm", "static_configs": scrape}]
    ).start()
    try:
        started = time.time()
        wait_until(lambda: len(prom.query("vllm:num_requests_running")) == 2, 30, "both targets scraped")
        time.sleep(24)
        obs, _desc, shape = observations_from_prometheus(
            prom.url,
            since=f"{int(time.time() - started)}s",
            until=time.time(),
            window="4s",
            selector="",
            shape=EngineShape(),
            tp_label="tp",
        )
    finally:
        prom.stop()
        for e in engines.values():
            e.stop.set()
        for server in servers:
            server.shutdown()
    assert shape.block_size == 16 and shape.num_gpu_blocks == 400
    by_tp = {tp: [o for o in obs if o.tp == tp] for tp in (1, 2)}
    assert all(len(v) >= 3 for v in by_tp.values()), {tp: len(v) for tp, v in by_tp.items()}
    assert {o.tp for o in obs} == {1, 2}
    fits = fits_by_tp(obs)
    assert set(fits) == {1, 2}
    # the TP=2 engine's steps cost half as much: its fit predicts about half the TP=1 fit's step
    for seqs in (2, 6):
        ratio = fits[2].cost.seconds(0, seqs, 0) / fits[1].cost.seconds(0, seqs, 0)
        assert 0.3 < ratio < 0.75, (seqs, ratio, fits)
