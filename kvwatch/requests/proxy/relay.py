"""The usage-chunk relay: one event stream's bytes on their way from the engine to the client.

Pure: no I/O and no clock. ``feed`` takes the bytes of one upstream read (already de-chunked) and
returns the bytes the client gets now; what it saw on the way is left on the relay for the caller
(``events``: the complete events the meter reads; ``noted``: usage, an accounting error or an engine
that sends usage unasked; ``done``: ``[DONE]`` went out and nothing is pending). The exchange
frames, writes, times and counts.

Only complete events leave (the usage chunk may need removing, and it can arrive split anywhere);
the incomplete rest is ``carry``. When kvwatch itself asked for usage (``strip``), the first
usage-only chunk is removed, and the final chunk (the one with a finish reason) and what follows are
held until it arrives: an engine writes its own fields on the last chunk, so they move to the usage
chunk when usage is requested (vLLM's ``system_fingerprint``, llama.cpp's ``timings``), and they are
put back (every field but ``sse.CHUNK_FIELDS``). Only
single-choice streams get here, and the hold lasts as long as the engine takes to write its next
chunk (the usage chunk follows the final chunk in the same step).

Only the chunk kvwatch caused is removed. vLLM 0.32 started with ``--enable-force-include-usage``
sends usage whether asked or not, and then on every chunk too (its ``should_include_usage``
returns ``(True, True)``: final and continuous usage). kvwatch asks for the final chunk only, so
a usage object on a chunk with choices, in a stream whose request did not ask for
``continuous_usage_stats``, is the engine's own doing: from there on nothing is removed or held,
and the final usage chunk reaches the client as a direct connection shows it (its counts are
still read: accounting loses nothing).

Whatever accounting does, the client's bytes are the engine's, in order, less only that chunk:
usage that cannot be read is an error in ``errors``, never an exception out of ``feed``.
"""

from __future__ import annotations

from kvwatch.requests import sse

MAX_EVENT_BYTES = 1 << 20  # an SSE "event" larger than this is relayed as plain bytes
MAX_HELD_EVENTS = 64  # events held after the final chunk while waiting for the usage chunk
MAX_HELD_BYTES = 1 << 20
DONE_EVENT = b"data: [DONE]"  # the last event of an OpenAI stream


def separator(data: bytes) -> bytes | None:
    """The stream's event separator, from its first complete event."""
    lf = data.find(b"\n\n")
    crlf = data.find(b"\r\n\r\n")
    if lf < 0 and crlf < 0:
        return None
    if crlf >= 0 and (lf < 0 or crlf < lf):
        return b"\r\n\r\n"
    return b"\n\n"


class UsageRelay:
    """One response's event stream; ``feed`` per upstream read, ``finish`` at its end."""

    __slots__ = (
        "asked",
        "carry",
        "chunk_usage_is_engines",
        "done",
        "done_mark",
        "engine_usage",
        "errors",
        "events",
        "forced_usage",
        "held",
        "held_bytes",
        "hold_final",
        "noted",
        "plain",
        "sep",
        "strip",
        "unasked",
        "usage",
    )

    def __init__(self, strip: bool, unasked: bool, asked_continuous: bool = False) -> None:
        self.strip = strip  # kvwatch asked for usage: the first usage-only chunk is its own, removed
        self.asked = strip  # kvwatch asked for usage in this stream's request
        self.unasked = unasked  # the client's body asked no usage (so an unremoved one is the engine's)
        self.chunk_usage_is_engines = not asked_continuous  # usage on a content chunk: nobody asked
        self.engine_usage = False  # the engine sends usage on its own in this stream: nothing removed
        self.sep: bytes | None = None
        self.done_mark = b""  # [DONE] and the separator: the bytes a finished stream ends with
        self.carry = b""  # bytes after the last complete event
        self.held: list[bytes] | None = None  # final chunk and after, waiting for the usage chunk
        self.held_bytes = 0
        self.hold_final = True  # False once held events outgrew MAX_HELD_*: relayed as they come
        self.plain = False  # not an event stream this relay understands: bytes pass as they come
        self.events = b""  # complete events of the last feed(), for the meter (without plain bytes)
        self.done = False
        self.noted = False  # usage, errors or forced_usage changed: the caller reads and resets them
        self.usage: sse.Usage | None = None
        self.errors: list[Exception] = []
        self.forced_usage = False  # a usage-only chunk in a stream whose client asked none, unremoved

    @property
    def holding(self) -> int:
        """Bytes kept back from the client now (counted in the proxy's buffer budget)."""
        return len(self.carry) + self.held_bytes

    def feed(self, data: bytes) -> bytes:
        """One upstream read in; the bytes for the client now out. Hot path."""
        if self.plain:
            self.events = b""
            return data
        if self.carry:
            data = self.carry + data
            self.carry = b""
        sep = self.sep
        if sep is None:
            sep = self.sep = separator(data)
            if sep is None:
                return self._keep(data)
            self.done_mark = DONE_EVENT + sep
        cut = data.rfind(sep)
        if cut < 0:
            return self._keep(data)
        cut += len(sep)
        if cut < len(data):
            self.carry = data[cut:]
            data = data[:cut]
        if self.strip:
            if self.held is not None or sse.USAGE_MARK in data or sse.FINISH.search(data):
                data = self._without_usage(data, sep)
        elif sse.USAGE_MARK in data:
            self._read_usage(data, sep)
        self.events = data
        if not self.carry and self.held is None and self._ends_with_done(data, sep):
            self.done = True
        return data

    def _ends_with_done(self, data: bytes, sep: bytes) -> bool:
        """The last event is ``[DONE]`` itself, not a line that merely ends with its text."""
        return data == self.done_mark or data.endswith(sep + self.done_mark)

    def finish(self) -> tuple[bytes, bytes]:
        """The response ended: (events held back, for the meter too; the incomplete rest, as it came)."""
        held = self._release()
        carry, self.carry = self.carry, b""
        self.events = b""
        return held, carry

    def overflow(self) -> bytes:
        """The proxy's buffer budget is spent: give up holding; what was kept goes now, in order,
        and the rest of the stream passes as plain bytes (usage no longer removed or read)."""
        held = self._release()
        carry, self.carry = self.carry, b""
        self.plain, self.strip = True, False
        self.events = held
        return held + carry

    def _release(self) -> bytes:
        held, self.held, self.held_bytes = self.held, None, 0
        if not held or self.sep is None:
            return b""
        sep = self.sep
        return b"".join(event + sep for event in held)

    def _keep(self, data: bytes) -> bytes:
        """No event boundary yet: keep the bytes, unless an 'event' grows beyond reason."""
        if len(data) <= MAX_EVENT_BYTES:
            self.carry = data
            self.events = b""
            return b""
        held = self._release()  # events held before these bytes leave before them
        self.plain = True
        self.events = held
        return held + data if held else data

    def _note_error(self, exc: Exception) -> None:
        self.errors.append(exc)
        self.noted = True

    def _note_usage(self, usage: sse.Usage | None) -> None:
        if usage is not None:
            self.usage = usage
            self.noted = True

    def _read_usage(self, data: bytes, sep: bytes) -> None:
        """Usage nobody here removes (the client asked, or the engine sends it anyway): read it."""
        try:
            usage = sse.find_usage(data, sep)
            if (
                self.unasked
                and not self.asked
                and not self.forced_usage
                and any(sse.is_usage_only(e) for e in data.split(sep) if sse.USAGE_MARK in e)
            ):
                self.forced_usage = self.noted = True
        except Exception as exc:
            self._note_error(exc)
            return
        self._note_usage(usage)

    def _read_usage_event(self, event: bytes) -> tuple[sse.Usage | None, list[tuple[bytes, bytes]]]:
        """``sse.read_usage_event``, whose failure (a usage chunk nested 100,000 deep) is noted."""
        try:
            return sse.read_usage_event(event)
        except Exception as exc:
            self._note_error(exc)
            return None, []

    def _engine_sends_usage(self, out: list[bytes], sep: bytes) -> None:
        """Usage on a chunk kvwatch did not ask it on: the engine forces usage, so the usage chunk
        to come is its own too; nothing more is removed, and what was held goes now, in order."""
        self.strip = False
        self.engine_usage = True
        if self.held:
            out += [held + sep for held in self.held]
        self.held, self.held_bytes = None, 0

    def _without_usage(self, data: bytes, sep: bytes) -> bytes:
        """Remove the usage chunk kvwatch asked for; returns the events to send now."""
        out: list[bytes] = []  # events with their separators, as they leave
        events = data.split(sep)
        rest = events.pop()  # empty, unless separators overlap at the end ("}\n\n\n": "\n" begins the next)
        if rest:
            self.carry = rest + self.carry
        for event in events:
            if self.strip and sse.USAGE_MARK in event and sse.is_usage_only(event):
                self.strip = False  # the one chunk kvwatch asked for; any later one is the engine's
                usage, moved = self._read_usage_event(event)
                self._note_usage(usage)
                if self.held:
                    self.held[0] = sse.with_fields(self.held[0], moved)
                    out += [held + sep for held in self.held]
                    self.held, self.held_bytes = None, 0
                blank = len(event) - len(event.lstrip(b"\r\n"))  # blank lines before it are not the chunk
                if blank:
                    out.append(event[:blank])
                continue
            if sse.USAGE_MARK in event:  # usage riding on a chunk with choices: read, keep
                self._note_usage(self._read_usage_event(event)[0])
                if self.strip and self.chunk_usage_is_engines and sse.USAGE_OBJECT.search(event):
                    self._engine_sends_usage(out, sep)
            if self.held is not None:
                self.held.append(event)
                self.held_bytes += len(event)
                too_many = len(self.held) > MAX_HELD_EVENTS or self.held_bytes > MAX_HELD_BYTES
                if event == DONE_EVENT or too_many:
                    # the stream's end without a usage chunk, or too much to hold: send it, in order
                    out += [held + sep for held in self.held]
                    self.held, self.held_bytes = None, 0
                    self.hold_final = event == DONE_EVENT
                continue
            if self.hold_final and self.strip and sse.FINISH.search(event):
                self.held, self.held_bytes = [event], len(event)
                continue
            out.append(event + sep)
        return b"".join(out)
