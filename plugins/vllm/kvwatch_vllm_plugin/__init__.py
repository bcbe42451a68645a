"""kvwatch's vLLM stat-logger plugin.

vLLM loads ``kvwatch_vllm_plugin.logger:KvwatchStatLogger`` through the ``vllm.stat_logger_plugins``
entry point and calls it on every engine step; it sends what the kvwatch agent needs (no prompt or
output text, no request ids) as compact JSON datagrams to a Unix socket, ``$KVWATCH_VLLM_SOCKET``
(default ``/run/kvwatch/vllm.sock``). ``wire`` (the datagram format and the sender) is standard
library only; ``logger`` is the vLLM side.
"""

from kvwatch_vllm_plugin.wire import DEFAULT_SOCKET, SOCKET_ENV, WIRE_VERSION

__all__ = ["DEFAULT_SOCKET", "SOCKET_ENV", "WIRE_VERSION"]
__version__ = "0.1.0"
