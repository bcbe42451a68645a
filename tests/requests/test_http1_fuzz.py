"""The HTTP/1 fuzz target (fuzz/http1.py) under hypothesis, time-boxed for the normal suite.

atheris runs the same ``one_input`` with coverage guidance for as long as one likes (docs/security.md);
here hypothesis feeds it random bytes and heads built from the grammar's pieces with random bytes
spliced in, a few hundred examples per run.
"""

from __future__ import annotations

import faulthandler
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.local import fuzz_target

fuzz = fuzz_target("http1")

PIECES = [
    b"GET",
    b"POST",
    b" ",
    b"/",
    b"/v1/chat/completions",
    b"http://h",
    b"*",
    b"HTTP/1.1",
    b"HTTP/1.0",
    b"HTTP/1.1 200 OK",
    b"\r\n",
    b"\n",
    b"\r",
    b"\x00",
    b"\t",
    b":",
    b": ",
    b"Host",
    b"Content-Length",
    b"Transfer-Encoding",
    b"chunked",
    b"5",
    b"-6",
    b"0x5",
    b"+5",
    b"1_0",
    b"0",
    b";",
    b"=",
    b'"',
    b"\\",
    b"hello",
    b"\x7f",
    b"\xff",
    b"%",
    b"?",
    b"#",
]
messages = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=8)), max_size=40).map(b"".join)
fragments = st.lists(st.one_of(st.sampled_from(PIECES), st.binary(max_size=4)), max_size=6).map(b"".join)
names = st.sampled_from([b"Host", b"X-A", b"Transfer-Encoding", b"Content-Length"])
field_lines = st.tuples(names | fragments, fragments).map(lambda nv: nv[0] + b": " + nv[1])
request_heads = st.tuples(
    st.sampled_from([b"GET", b"POST"]) | fragments,
    st.sampled_from([b"/", b"/v1/chat/completions", b"http://h/x"]) | fragments,
    st.sampled_from([b"HTTP/1.1", b"HTTP/1.0"]),
    st.lists(field_lines, max_size=5),
).map(lambda h: b"\r\n".join([h[0] + b" " + h[1] + b" " + h[2], *h[3]]))
response_heads = st.tuples(
    st.sampled_from([b"HTTP/1.1 200 OK", b"HTTP/1.0 404 Not Found"]) | fragments,
    st.lists(field_lines, max_size=5),
).map(lambda h: b"\r\n".join([h[0], *h[1]]))
chunks = st.tuples(
    st.binary(max_size=12),
    st.sampled_from([b"", b";a=b", b";", b' ;q="x"']) | fragments,
    st.sampled_from([None, b"-6", b"0x5", b"+5", b"1_0", b" 5", b"1" * 17]),
).map(lambda c: (c[2] if c[2] is not None else b"%x" % len(c[0])) + c[1] + b"\r\n" + c[0] + b"\r\n")
chunked_bodies = st.tuples(st.lists(chunks, max_size=5), st.lists(field_lines, max_size=2)).map(
    lambda b: b"".join(b[0]) + b"0\r\n" + b"".join(line + b"\r\n" for line in b[1]) + b"\r\n"
)
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(autouse=True)
def hang_watchdog():
    """A parser that loops forever is a finding too: end the process with tracebacks, not the CI job."""
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@FUZZ
@example(data=b"HTTP/1.1 002 OK\r\np: ttream")  # atheris: accepted as 2, rendered "HTTP/1.1 2 OK"
@given(data=st.one_of(st.binary(max_size=300), messages, request_heads, response_heads, chunked_bodies))
def test_http1_parsers_hold_their_invariants(data: bytes) -> None:
    fuzz.one_input(data)


def test_seed_corpus_passes() -> None:
    for seed in (Path(fuzz.__file__).parent / "corpus" / "http1").iterdir():
        fuzz.one_input(seed.read_bytes())
