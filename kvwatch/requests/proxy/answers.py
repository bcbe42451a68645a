"""The answers kvwatch's proxy gives itself (503 shed, 408, 413, 502/504 ...), as HTTP/1.1 bytes."""

from __future__ import annotations

import json

from kvwatch.requests.http1 import Headers, render_head

REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    413: b"Content Too Large",
    431: b"Request Header Fields Too Large",
    501: b"Not Implemented",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
    505: b"HTTP Version Not Supported",
}


def error_response(status: int, message: str, close: bool) -> bytes:
    body = json.dumps(
        {"error": {"message": f"kvwatch proxy: {message}", "type": "proxy_error", "code": status}}
    ).encode()
    headers: Headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if close:
        headers.append((b"connection", b"close"))
    return render_head(b"HTTP/1.1 %d %b" % (status, REASONS.get(status, b"Error")), headers) + body
