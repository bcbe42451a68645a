"""What a new user gets: ``kvwatch report`` works after the README's first install command, and the
daemon never loads pandas or numpy (they are the report's; the agent's memory stays small).

* The venv is made exactly as the README's first command says (``python3 -m venv .venv &&
  .venv/bin/pip install -e '.[fast]'``), in a temporary directory (the repository's own .venv has
  the test extras, which would hide a missing dependency). pip's cache makes it quick after the
  first time.
* ``kvwatch run`` as a process: once it is ready, no numpy or pandas file is mapped into it
  (``/proc/PID/maps``), whatever modules were imported by whom.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.local import free_port, wait_until
from tests.report.ledgers import HAND, write

ROOT = Path(__file__).resolve().parent.parent


def readme_install_command() -> str:
    """The README's first command, up to the demo it then starts."""
    first = re.search(r"```sh\n(.+?)\n", (ROOT / "README.md").read_text()).group(1)  # type: ignore[union-attr]
    install = first.split(" && .venv/bin/kvwatch demo")[0]
    assert install == "python3 -m venv .venv && .venv/bin/pip install -e '.[fast]'", first
    return install


@pytest.mark.slow
def test_kvwatch_report_works_after_the_readme_install(tmp_path: Path) -> None:
    command = readme_install_command().replace("-e '.[fast]'", f"-e '{ROOT}[fast]'")
    install = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False
    )
    assert install.returncode == 0, install.stderr[-3000:]
    ledger = write(tmp_path / "ledger.jsonl", HAND)
    report = subprocess.run(
        [str(tmp_path / ".venv" / "bin" / "kvwatch"), "report", str(ledger)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert report.returncode == 0, report.stderr[-3000:]
    assert "0-1k" in report.stdout and "5k-10k" in report.stdout, report.stdout


def test_the_daemon_maps_neither_pandas_nor_numpy(tmp_path: Path) -> None:
    listen, proxy = free_port(), free_port()
    config = {
        "listen": f"127.0.0.1:{listen}",
        "replicas": [
            {
                "name": "r0",
                "metrics_url": f"http://127.0.0.1:{free_port()}/metrics",
                "api_url": f"http://127.0.0.1:{free_port()}",
                "proxy_listen": f"127.0.0.1:{proxy}",
                "model_name": "tiny",
            }
        ],
        "ledger": {"path": str(tmp_path / "ledger.jsonl")},
    }
    path = tmp_path / "kvwatch.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "run", "--config", str(path)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def serving() -> bool:
            assert proc.poll() is None, "kvwatch run exited"
            return httpx.get(f"http://127.0.0.1:{listen}/metrics", timeout=2).status_code == 200

        wait_until(serving, 30, "kvwatch run to serve /metrics", 0.2, retry_on=(httpx.HTTPError,))
        # a request through the proxy (the engine is not there: 502) runs the request path too
        httpx.post(f"http://127.0.0.1:{proxy}/v1/completions", json={"prompt": "x"}, timeout=10)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "_ssl" in maps  # extension modules the daemon does load are listed (the proxy's ssl)
        assert "numpy" not in maps and "pandas" not in maps
    finally:
        proc.terminate()
        proc.wait(timeout=20)
