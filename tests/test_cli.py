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
    result = subprocess.run([sys.executable, "-m", "kvwatch", command, "--help"], capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    usage, _, rest = result.stdout.partition("\n\n")
    assert usage.startswith(f"usage: kvwatch {command}")
    description = rest.split("\npositional arguments:")[0].split("\noptions:")[0]
    assert len(description.split()) >= 8, f"{command} --help has no real description: {description!r}"


def test_no_command_prints_help_and_fails():
    result = subprocess.run([sys.executable, "-m", "kvwatch"], capture_output=True, text=True, timeout=60,
                            check=False)
    assert result.returncode == 2 and "COMMAND" in result.stdout
