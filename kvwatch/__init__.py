"""kvwatch: KV-cache and per-output-length-band latency monitoring for LLM inference nodes."""

__version__ = "0.1.0"
