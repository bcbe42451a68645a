"""Every command has --help that says what it does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvwatch.cli import COMMANDS, build_parser


def test_every_listed_command_is_built():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert set(sub.choices) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_explains_the_command(command):
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    usage, _, rest = result.stdout.partition("\n\n")
    assert usage.startswith(f"usage: kvwatch {command}")
    description = rest.split("\npositional arguments:")[0].split("\noptions:")[0]
    assert len(description.split()) >= 8, f"{command} --help has no real description: {description!r}"


def test_no_command_prints_help_and_fails():
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2 and "COMMAND" in result.stdout


def test_run_raises_the_open_files_soft_limit_to_the_hard_limit() -> None:
    """A soft limit of 256 with 300 keep-alive clients dropped new ones silently."""
    import resource

    def low_soft_limit() -> None:
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    code = (
        "import resource; from kvwatch.commands.run import raise_open_files_limit as r; "
        "soft = lambda: resource.getrlimit(resource.RLIMIT_NOFILE)[0]; print(soft(), *r(), soft())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=low_soft_limit,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout.split()
    before, soft, hard, after = (int(v) for v in out)
    assert before == 256 and soft == after > 256
    assert after == min(hard, 1 << 20) or hard == resource.RLIM_INFINITY


@pytest.mark.parametrize(
    "args",
    [
        ["rules", "--out", "{file}/sub"],
        ["dashboards", "--out", "{file}/sub"],
        ["manifests", "--out", "{file}/sub"],
        ["docs", "--file", "{file}/metrics.md"],
    ],
)
def test_an_output_path_that_cannot_be_written_is_one_line_not_a_traceback(tmp_path, args):
    # an --out under a file raised NotADirectoryError out of every generator
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    argv = [arg.format(file=blocker) for arg in args]
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", *argv], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "Not a directory" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # NaN passed `speed <= 0` and ran away: it ignored --duration and SIGINT, 24 GB in 7 minutes
        (["--speed", "nan"], "--speed must be a number > 0 and at most 1000, got nan"),
        (["--rate", "inf"], "--rate must be a number > 0 and at most 100, got inf"),
        (["--rate", "-1"], "--rate must be a number > 0"),  # a ValueError traceback from the workload
        (["--duration", "nan"], "--duration must be a finite number of seconds > 0"),
        (["--tp", "3"], "tp=3 cannot split the model's 8 KV heads"),  # a traceback from the engine
    ],
)
def test_demo_refuses_numbers_it_cannot_run_on(args, message):
    result = subprocess.run(
        [sys.executable, "-m", "kvwatch", "demo", "--listen", "127.0.0.1:0", "--view", "none", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
