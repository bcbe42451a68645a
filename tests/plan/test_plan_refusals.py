"""Flags and files `kvwatch plan` cannot use end in one clear line and exit 1: no hang, no traceback,
and no advice that is not true."""

import contextlib
import gzip
import json
import math
import signal

import pytest

from kvwatch.cli import main
from kvwatch.model import DEFAULT_BANDS
from kvwatch.plan.calibration import Calibration, EngineShape
from kvwatch.plan.candidate import Candidate, CandidateError
from kvwatch.plan.compare import BandAttainment, Evaluated, gap_advice, hardware_grid
from kvwatch.plan.fit import StepObservation, fit_step_cost
from kvwatch.plan.inputs import read_workload
from kvwatch.plan.replay import replay

LINE = {
    "v": 1,
    "replica": "r0",
    "outcome": "completed",
    "prompt_tokens": 100,
    "output_tokens": 50,
    "max_tokens": 200,
    "e2e_seconds": 2.0,
    "ttft_seconds": 0.1,
}


def _ledger(tmp_path, n: int = 3):
    path = tmp_path / "ledger.jsonl"
    path.write_text("".join(json.dumps({**LINE, "started_at": 1.7e9 + i}) + "\n" for i in range(n)))
    return path


@contextlib.contextmanager
def _within(seconds: float):
    """Fail instead of hanging: the bug this guards against was an endless loop."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("every", ["-1", "0", "nan", "inf"])
def test_a_sample_interval_that_is_not_a_positive_number_is_refused(tmp_path, capsys, every):
    """-1 and nan hung (the sampler never reached the end of the replay); 0 ran with the default."""
    with _within(20):
        assert main(["plan", "replay", str(_ledger(tmp_path)), "--sample-every", every]) == 1
    assert f"--sample-every must be a finite number of simulated seconds > 0, got {every}" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("every", [-1.0, 0.0, math.nan, math.inf])
def test_replay_refuses_a_bad_sample_interval_as_a_value_error(tmp_path, every):
    workload = read_workload([str(_ledger(tmp_path))])
    with _within(20), pytest.raises(ValueError, match="--sample-every must be a finite number"):
        replay(workload, Candidate(model="llama-3.1-8b", dp=1), bands=DEFAULT_BANDS, sample_every=every)


def test_an_unknown_model_is_refused_with_the_known_ones(tmp_path, capsys):
    args = ["plan", "compare", str(_ledger(tmp_path)), "--slo", "alerts/slo.yaml", "--grid", "small"]
    assert main([*args, "--model", "nope", "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "--model: unknown model 'nope'; known presets:" in err and "qwen3-32b" in err
    with pytest.raises(CandidateError, match="unknown model 'nope'"):
        hardware_grid(8, "nope")


@pytest.mark.parametrize("command", ["replay", "export"])
def test_a_truncated_gzip_ledger_is_refused_by_name(tmp_path, capsys, command):
    """Past the 64 KiB the format sniffer reads, the cut came out of the ledger reader as an EOFError."""
    data = gzip.compress(_ledger(tmp_path, 2000).read_bytes())
    cut = tmp_path / "ledger.jsonl.gz"
    cut.write_bytes(data[: len(data) // 2])
    extra = ["-o", str(tmp_path / "trace.jsonl")] if command == "export" else []
    assert main(["plan", command, str(cut), *extra]) == 1
    assert f"{cut}: cannot decompress: Compressed file ended before" in capsys.readouterr().err


def test_a_calibration_without_the_engines_kv_shape_says_to_record_it(tmp_path, capsys):
    """It said '(pass --calibration)' to a user who had passed --calibration."""
    obs = [StepObservation(p, s, 0.004 + 2e-5 * p + 0.0015 * s) for p in (0, 500, 1000) for s in (1, 4, 8)]
    cal = Calibration("step_samples", fit_step_cost(obs), EngineShape(), window="file steps.jsonl")
    cal.dump(tmp_path / "cal.yaml")
    assert main(["plan", "replay", str(_ledger(tmp_path)), "--calibration", str(tmp_path / "cal.yaml")]) == 1
    err = capsys.readouterr().err
    assert "this calibration (step_samples, file steps.jsonl) did not record it" in err
    assert "re-run `kvwatch plan calibrate` with --engine-url" in err and "pass --calibration" not in err


def test_the_lower_rate_advice_does_not_say_limit_thins_the_trace():
    """--limit keeps the first N requests at the recorded arrival rate; it never thinned anything."""
    preempting = Evaluated(
        Candidate(name="c", dp=1), None, (BandAttainment("e2e", "all", 10, 0.5, 0.9),), preemptions=7
    )
    advice = " ".join(gap_advice([preempting], 8, {}))
    assert "thinned" not in advice
    assert "--limit keeps the first N requests at the recorded rate, it does not thin them" in advice


def test_a_candidate_router_that_needs_weights_no_key_gives_is_refused_by_name(tmp_path, capsys):
    # router: weighted reached the simulator's router without weights: a ValueError traceback
    candidate = tmp_path / "weighted.yaml"
    candidate.write_text("router: weighted\n")
    assert main(["plan", "replay", str(_ledger(tmp_path)), "--candidate", str(candidate)]) == 1
    err = capsys.readouterr().err
    assert "router 'weighted' is not one of round_robin, least_loaded, skewed" in err
    assert "Traceback" not in err


def test_a_tensor_parallel_degree_that_cannot_split_the_kv_heads_cannot_run(tmp_path, capsys):
    # tp: 3 on Llama-3.1-8B (8 KV heads) was simulated with 8/3 heads per rank; vLLM refuses it
    candidate = tmp_path / "tp3.yaml"
    candidate.write_text("model: llama-3.1-8b\ntp: 3\ndp: 1\n")
    assert main(["plan", "replay", str(_ledger(tmp_path)), "--candidate", str(candidate)]) == 1
    assert "tp=3 cannot split the model's 8 KV heads" in capsys.readouterr().err
    for tp in (1, 2, 4, 8, 16):  # shards, or (16) replicates each head on two ranks
        replay(
            read_workload([str(_ledger(tmp_path))]),
            Candidate(model="llama-3.1-8b", tp=tp, dp=1),
            None,
            bands=DEFAULT_BANDS,
        )
