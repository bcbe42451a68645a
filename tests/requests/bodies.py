"""Chat request bodies that more than one proxy test module sends. Two that differ, kept apart: the
fault, pool and reuse tests stream and set no max_tokens; the conformance and longest-gap tests cap
the answer at 64 tokens and say for themselves whether to stream."""

from __future__ import annotations

STREAMING_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True}
CHAT_MAX_64_TOKENS = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
