"""``relay.py UPSTREAM PORT PAGES``: serve GET on 127.0.0.1:PORT by fetching UPSTREAM, and append every
page served to PAGES (JSON lines: ``arrived``, the wall-clock time the request came in, ``took``, the
seconds the upstream took to serve it, and ``text``).

Run as its own process by ``stack.RecordingRelay`` so that the test's event loop and the relay do not
share an interpreter lock on a busy two-core machine.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

UPSTREAM, PORT, PAGES = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
WRITE = threading.Lock()


class Relay(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name
        arrived = time.time()
        with urllib.request.urlopen(UPSTREAM, timeout=60) as reply:
            status, content_type, body = reply.status, reply.headers.get("Content-Type"), reply.read()
        with WRITE, PAGES.open("a") as pages:
            took = time.time() - arrived
            pages.write(json.dumps({"arrived": arrived, "took": took, "text": body.decode()}) + "\n")
        self.send_response(status)
        self.send_header("Content-Type", content_type or "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass

    def handle(self) -> None:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the scraper timed out
            super().handle()


server = ThreadingHTTPServer(("127.0.0.1", PORT), Relay)
PAGES.touch()
server.serve_forever()
