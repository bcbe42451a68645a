"""``kvwatch demo`` from the command line: it starts, serves /metrics, tells the story, ends cleanly."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from tests.local import wait_until

pytestmark = pytest.mark.slow


def test_demo_runs_tells_the_kv_story_and_prints_a_summary():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvwatch",
            "demo",
            "--duration",
            "20",
            "--speed",
            "60",
            "--view",
            "lines",
            "--listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = proc.stdout.readline()
        match = re.search(r"metrics (http://127\.0\.0\.1:\d+)/metrics", first)
        assert match, first
        base = match.group(1)

        def scraped_with_requests() -> str:
            body = httpx.get(f"{base}/metrics", timeout=5).text
            return body if "kvwatch_requests_total{" in body and 'replica="replica-7"' in body else ""

        body = wait_until(scraped_with_requests, 15, "the demo's requests on /metrics", interval_s=0.5)
        assert 'kvwatch_target_up{backend="vllm",replica="replica-0"} 1.0' in body
        assert "kvwatch_gpu_memory_used_bytes{" in body  # fake GPUs follow the simulator
        assert httpx.get(f"{base}/-/ready", timeout=5).status_code == 200
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    summary = out[out.index("kvwatch demo summary") :]
    peaks = dict(re.findall(r"(replica-\d) (\d+)%", summary.split("peak KV usage:")[1].splitlines()[0]))
    assert int(peaks["replica-0"]) >= 95, summary  # the pinned replica fills ...
    assert max(int(v) for k, v in peaks.items() if k != "replica-0") < 80, summary  # ... the others don't
    assert int(re.search(r"preemptions: (\d+)", summary).group(1)) > 0
    stranded = int(re.search(r"peak stranded KV: ([\d,]+)", summary).group(1).replace(",", ""))
    assert stranded > 100_000
    assert re.search(r"^\s+5k-10k\s+\d+", summary, re.MULTILINE), summary  # per-band latency table
    assert "Traceback" not in err
    # the summary is what the run measured, read before the clients still waiting left: kvwatch's
    # table counts the requests the clients saw end, not the ones the demo's own teardown cut off
    sent = int(re.search(r"(\d+) requests sent", summary).group(1))
    outcomes = {
        k: int(v) for k, v in re.findall(r"(\w+) (\d+)", summary.split("client outcomes:")[1].splitlines()[0])
    }
    still = re.search(r"still in flight at the end: (\d+)", summary)
    open_at_end = int(still.group(1)) if still else 0
    assert sum(outcomes.values()) + open_at_end == sent, summary
    table = re.findall(r"^\s{4}(\S+)\s+(\d+)\s+\d+%", summary, re.MULTILINE)
    # a band's outcomes are all in the table: completed, truncated (hit max_tokens) and aborted
    # (a request refused before any output, if one were, would sit in "unknown" as rejected)
    shares = re.findall(r"^\s{4}(\S+)\s+\d+\s+(\d+)%\s+(\d+)%\s+(\d+)%", summary, re.MULTILINE)
    assert len(shares) == len(table), summary
    assert all(97 <= sum(map(int, row[1:])) <= 103 for row in shares if row[0] != "unknown"), summary
    counted = sum(int(n) for _band, n in table)
    # a request the proxy has recorded can still be open for its client for a loop turn or two
    assert abs(counted - sum(outcomes.values())) <= 3, summary


def test_demo_refuses_bad_arguments_with_a_clear_message():
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", "demo", "--listen", "nowhere"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and "--listen" in result.stderr
