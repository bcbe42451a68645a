"""Calibration from the vLLM plugin's step datagrams, encoded by the plugin's own wire module."""

import json
import random
import sys
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.plan.calibration import load_calibration

from .helpers import TRUE_COST

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugins" / "vllm"))
from kvwatch_vllm_plugin import wire

CAPACITY = 25600  # 200 blocks of 128 tokens, as the engine shape says


def test_plugin_datagrams_calibrate_every_term_including_kv(tmp_path, monkeypatch):
    rng = random.Random(4)
    lines = []
    for n in range(400):
        ctx_t = rng.choice([0, 0, rng.randint(1, 2000)])
        gen_r = rng.randint(0 if ctx_t else 1, 8)
        kv = rng.uniform(0.05, 1.0)
        ms = TRUE_COST.seconds(ctx_t, gen_r, kv * CAPACITY) * 1000 * (1 + rng.gauss(0, 0.02))
        step = {
            "run": gen_r + (1 if ctx_t else 0),
            "wait": 0,
            "kv": kv,
            "it": [1 if ctx_t else 0, ctx_t, gen_r, gen_r, ms],
        }
        for body in wire.encode(
            {"v": wire.WIRE_VERSION, "e": 0, "p": 1, "n": n, "t": 1.7e9 + n, "d": 0}, [step], [], [], 0
        ):
            lines.append(json.dumps(body))
    path = tmp_path / "datagrams.jsonl"
    path.write_text("\n".join(lines) + "\n")

    from kvwatch.plan import sources
    from kvwatch.plan.calibration import EngineShape

    monkeypatch.setattr(
        sources,
        "engine_shape",
        lambda *a, **k: EngineShape(model_name="tiny", block_size=128, num_gpu_blocks=200),
    )
    out = tmp_path / "cal.yaml"
    assert (
        main(
            [
                "plan",
                "calibrate",
                "--step-samples",
                str(path),
                "--engine-url",
                "http://127.0.0.1:9",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    cal = load_calibration(out)
    assert cal.source == "step_samples" and cal.fit.quality.unfitted_terms == ()
    assert cal.cost.per_kv_token_s == pytest.approx(TRUE_COST.per_kv_token_s, rel=0.1)
    assert cal.cost.per_prefill_token_s == pytest.approx(TRUE_COST.per_prefill_token_s, rel=0.05)


def test_datagrams_without_the_batch_shape_say_which_vllm_flag_is_missing(tmp_path, capsys):
    body = wire.encode(
        {"v": wire.WIRE_VERSION, "e": 0, "p": 1, "n": 0, "t": 1.7e9, "d": 0},
        [{"run": 1, "wait": 0, "kv": 0.1}],
        [],
        [],
        0,
    )[0]
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(body) + "\n")
    assert main(["plan", "calibrate", "--step-samples", str(path), "-o", str(tmp_path / "c.yaml")]) == 1
    assert "--enable-logging-iteration-details" in capsys.readouterr().err
