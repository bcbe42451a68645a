"""The tcpdump helper itself: what was on the wire when its block ends is in the capture.

tcpdump gets packets from the kernel in blocks that retire after about 1 s; a capture stopped as soon
as the traffic stops used to lose the open block (a clean-clone run lost the last of 42 requests).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.local import free_port

from .wire import requests_on_wire, tcpdump


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


async def _post(port: int, body: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    await reader.read()
    writer.close()


async def test_a_request_sent_just_before_the_capture_stops_is_in_it(tmp_path: Path) -> None:
    port = free_port()
    server = await asyncio.start_server(_answer, "127.0.0.1", port)
    pcap = tmp_path / "last.pcap"
    try:
        async with tcpdump("-U", "-s", "0", "-w", str(pcap), f"tcp dst port {port}"):
            for max_tokens in (1, 2, 3):
                await _post(port, json.dumps({"max_tokens": max_tokens}).encode())
    finally:
        server.close()
        await server.wait_closed()
    seen = requests_on_wire(pcap, port)
    assert [r.json()["max_tokens"] for r in seen] == [1, 2, 3]
    assert all(r.path == "/v1/completions" and r.method == "POST" for r in seen)
