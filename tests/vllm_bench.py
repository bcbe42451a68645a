"""``vllm bench serve`` as the independent client: the one command line the proxy test and the OTLP
bench both run (random prompts, whole-ASCII-word tokens, per-request detail saved)."""

from __future__ import annotations

import json
from pathlib import Path

#: vLLM's CPU build, offline: the tokenizer and model are local
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}


def ascii_word_tokens(model_dir: Path) -> list[int]:
    """Token ids whose text is a whole ASCII word piece (byte-level BPE: optional leading space), so
    the first streamed event always has text (tests/requests/test_independent_clients.py, "Why
    allowed_token_ids")."""
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(
        i
        for token, i in vocab.items()
        if token.lstrip("\u0120").isascii() and token.lstrip("\u0120").isalpha()
    )


def serve_command(
    vllm: Path, base_url: str, model_dir: Path, requests: int, in_flight: int, result: Path
) -> list[str]:
    """``vllm bench serve`` against ``base_url``: ``requests`` completions, ``in_flight`` at a time at
    30 requests/s, 24-136 output tokens each, the detailed result written to ``result``."""
    extra = {"allowed_token_ids": ascii_word_tokens(model_dir), "temperature": 0}
    return [
        str(vllm),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        "tiny",
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        "80",
        "--random-range-ratio",
        "0.7",
        "--num-prompts",
        str(requests),
        "--max-concurrency",
        str(in_flight),
        "--request-rate",
        "30",
        "--ignore-eos",
        "--seed",
        "12",
        "--extra-body",
        json.dumps(extra),
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result.parent),
        "--result-filename",
        result.name,
    ]
