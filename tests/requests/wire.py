"""Requests as tcpdump saw them: a minimal pcap reader (what ``tcpdump -w`` writes on Linux loopback)
and the client->server byte stream of each TCP connection cut into HTTP/1.1 requests.

Each request gets the capture time of the segment that carried its first byte, on the epoch clock
(``tcpdump -tt``), comparable with ``RequestRecord.started_at``. Written here because the check must
not trust kvwatch's own HTTP parser; it only knows Content-Length bodies (what the clients send).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import signal
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

_LINK_HEADER = {1: 14, 113: 16, 276: 20}  # Ethernet (loopback), Linux cooked v1 and v2
_PCAP_MAGIC = {
    b"\xd4\xc3\xb2\xa1": ("<", 1e-6),
    b"\xa1\xb2\xc3\xd4": (">", 1e-6),
    b"\x4d\x3c\xb2\xa1": ("<", 1e-9),
    b"\xa1\xb2\x3c\x4d": (">", 1e-9),
}


@dataclass(frozen=True, slots=True)
class WireRequest:
    first_byte_at: float  # epoch seconds: capture time of the segment with the request's first byte
    client_port: int
    method: str
    path: str
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body)


def _segments(pcap: Path, server_port: int) -> list[tuple[float, int, int, bytes]]:
    """(time, client port, TCP sequence number, payload) of every client->server segment with data."""
    data = pcap.read_bytes()
    endian, unit = _PCAP_MAGIC[data[:4]]
    link = struct.unpack(endian + "I", data[20:24])[0]
    skip = _LINK_HEADER[link]
    out = []
    pos = 24
    while pos + 16 <= len(data):
        sec, frac, incl, _orig = struct.unpack(endian + "IIII", data[pos : pos + 16])
        frame = data[pos + 16 : pos + 16 + incl]
        pos += 16 + incl
        ip = frame[skip:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:  # IPv4 TCP only (the proxy listens on 127.0.0.1)
            continue
        ip_len = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        tcp = ip[ip_len:total]
        src, dst, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if dst == server_port and payload:
            out.append((sec + frac * unit, src, seq, payload))
    return out


def requests_on_wire(pcap: Path, server_port: int) -> list[WireRequest]:
    """Every complete request the clients sent to ``server_port``, in order of first byte."""
    streams: dict[int, list[tuple[float, int, bytes]]] = {}
    for t, port, seq, payload in _segments(pcap, server_port):
        streams.setdefault(port, []).append((t, seq, payload))
    found: list[WireRequest] = []
    for port, segments in streams.items():
        base = min(seq for _, seq, _ in segments)  # sequence numbers relative to the first data byte
        stream = bytearray()
        times: list[tuple[int, float]] = []  # (stream offset where a segment starts, its time)
        for t, seq, payload in sorted(segments, key=lambda s: ((s[1] - base) % (1 << 32), s[0])):
            offset = (seq - base) % (1 << 32)
            if offset + len(payload) <= len(stream):
                continue  # a retransmission
            times.append((len(stream), t))
            stream += payload[len(stream) - offset :] if offset < len(stream) else payload
        found += _split(bytes(stream), times, port)
    return sorted(found, key=lambda r: r.first_byte_at)


def _split(stream: bytes, times: list[tuple[int, float]], port: int) -> list[WireRequest]:
    out = []
    offset = 0
    while True:
        end = stream.find(b"\r\n\r\n", offset)
        if end < 0:
            return out
        lines = stream[offset:end].decode("latin-1").split("\r\n")
        method, path, _version = lines[0].split(" ")
        headers = dict(line.split(":", 1) for line in lines[1:])
        length = int({k.strip().lower(): v.strip() for k, v in headers.items()}.get("content-length", "0"))
        body = stream[end + 4 : end + 4 + length]
        if len(body) < length:
            return out
        first = max(t for start, t in times if start <= offset)
        out.append(WireRequest(first, port, method, path, body))
        offset = end + 4 + length


_STATS = re.compile(rb"(\d+) packets? captured, (\d+) packets? received by filter")


async def _caught_up(proc: asyncio.subprocess.Process, timeout_s: float = 30.0) -> None:
    """Wait until tcpdump has written every packet its filter took (its SIGUSR1 statistics), so that
    stopping it loses none: the kernel hands packets over in blocks that retire after about 1 s,
    and tcpdump stopped before then drops the open block (a clean-clone run lost a request so).
    On loopback the filter takes each packet twice, going out and coming in, and tcpdump keeps one."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    stats = b""
    while True:
        proc.send_signal(signal.SIGUSR1)
        line = await asyncio.wait_for(proc.stderr.readline(), timeout_s)  # type: ignore[union-attr]
        counts = _STATS.search(line)
        assert counts, f"tcpdump's statistics line not understood: {line!r}"
        captured, received = int(counts.group(1)), int(counts.group(2))
        if 2 * captured >= received:
            return
        stats = line
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"tcpdump did not write what it captured within {timeout_s:g} s: {stats!r}")
        await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def tcpdump(*args: str) -> AsyncIterator[list[bytes]]:
    """Debian ``tcpdump -i lo -n`` (root) with ``args`` (options, then the filter), running for the
    block; then its standard output, in the list it yields. A capture the kernel dropped packets of
    fails here, as the instrument's fault, not kvwatch's."""
    binary = shutil.which("tcpdump") or "/usr/bin/tcpdump"
    if not Path(binary).exists():
        pytest.fail(
            "tcpdump is not installed: run scripts/setup-test-env.sh (apt-get install tcpdump)", pytrace=False
        )
    proc = await asyncio.create_subprocess_exec(
        binary,
        "-i",
        "lo",
        "-n",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    output: list[bytes] = []
    try:
        line = b""
        while b"listening on" not in line:  # after "verbose output suppressed" where it writes text
            line = await asyncio.wait_for(proc.stderr.readline(), 10)  # type: ignore[union-attr]
            assert line, "tcpdump did not start"
        yield output
    finally:
        if proc.returncode is None:
            await _caught_up(proc)
            proc.terminate()
        out, summary = await asyncio.wait_for(proc.communicate(), 10)
    dropped = re.search(rb"(\d+) packets? dropped by kernel", summary or b"")
    assert dropped is None or dropped.group(1) == b"0", f"tcpdump lost packets: {summary!r}"
    output.append(out)
