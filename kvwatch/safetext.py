"""Outsider text made safe to show and to export: every non-printable character as a visible escape.

Engines choose label values (``model_name``, ``finished_reason``, DP ranks), served model names and
error text; a pod's annotations choose a model name. Raw control characters in them (C0, DEL, C1,
ESC sequences, line separators, bidi overrides) would reach an operator's terminal through
``kvwatch top``, ``curl /metrics`` or a log viewer and could clear the screen or paint a fake
alert. ``terminal_safe`` writes each one as an escape (``\\x1b``, ``\\x9b``, ``\\u202e``): one rule
for the terminal view (``status/top.py``) and for every label value from outside, applied where
the value enters kvwatch (``engines/exposition_parser.py``, ``requests/accounting.py``
``ModelLabels``, ``discovery/pods.py``), so /metrics, the status page and the ledger all carry the
escaped text.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


def terminal_safe(text: str) -> str:
    """``text`` with every non-printable character written as an escape; printable text unchanged."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown_url(url: str) -> str:
    """A configured URL as a log line, an error or the status page shows it: a password (``user:pw@``)
    or a query (``?token=...``) can be a secret, and both stay out (``***@``, ``?...``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unreadable URL)"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, netloc, parts.path, "..." if parts.query else "", ""))
