"""ProcReader on a fake /proc: NSpid, children, the two visible-device variables, pid files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvwatch.gpu.processes import ProcReader, read_pid_file
from kvwatch.model import ProcessInfo
from tests.local import wait_until

from .fakes import FakeProc


def test_nspid_chain_and_parent_are_read(proc: FakeProc):
    proc.add(4100, ppid=4000, ns_pids=(4100, 1))
    info = ProcReader(proc.root).info(4100)
    assert info == ProcessInfo(pid=4100, ppid=4000, ns_pids=(4100, 1))
    assert info.all_pids == (4100, 1)


def test_missing_process_reads_none(proc: FakeProc):
    assert ProcReader(proc.root).info(999) is None


def test_only_the_two_visible_device_variables_are_kept(proc: FakeProc):
    proc.add(
        10,
        ppid=1,
        environ={
            "HF_TOKEN": "hf_secret",
            "CUDA_VISIBLE_DEVICES": "2,3",
            "NVIDIA_VISIBLE_DEVICES": "GPU-abc",
            "OPENAI_API_KEY": "sk-secret",
            "CUDA_VISIBLE_DEVICES_EXTRA": "9",
        },
    )
    info = ProcReader(proc.root).info(10)
    assert (info.cuda_visible_devices, info.nvidia_visible_devices) == ("2,3", "GPU-abc")
    assert "secret" not in repr(info)


def test_unreadable_environ_means_unknown_not_an_error(proc: FakeProc):
    proc.add(10, ppid=1, environ={"CUDA_VISIBLE_DEVICES": "0"})
    (proc.root / "10" / "environ").unlink()
    info = ProcReader(proc.root).info(10)
    assert info is not None and info.cuda_visible_devices is None


def test_tree_follows_children_files(proc: FakeProc):
    proc.add(100, ppid=1, children=(101, 102))
    proc.add(101, ppid=100, children=(103,))
    proc.add(102, ppid=100)
    proc.add(103, ppid=101)
    proc.add(200, ppid=1)  # unrelated
    assert sorted(ProcReader(proc.root).tree(100)) == [100, 101, 102, 103]


def test_tree_scans_parents_when_the_kernel_has_no_children_files(tmp_path: Path):
    proc = FakeProc(tmp_path, children_files=False)
    proc.add(100, ppid=1, comm="vllm (engine) 0")  # spaces and parentheses in comm
    proc.add(101, ppid=100, comm="VllmWorker TP0")
    proc.add(102, ppid=101)
    proc.add(200, ppid=1)
    reader = ProcReader(proc.root)
    assert reader.ppid(100) == 1
    assert sorted(reader.tree(100)) == [100, 101, 102]


def test_pid_file_is_read(tmp_path: Path):
    path = tmp_path / "engine.pid"
    path.write_text("4242\n")
    assert read_pid_file(path) == 4242


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read"),
        ("", "expected a positive process id"),
        ("vllm\n", "expected a positive process id"),
        ("0\n", "expected a positive process id"),
    ],
)
def test_bad_pid_file_names_the_file_and_the_problem(tmp_path: Path, content: str | None, message: str):
    path = tmp_path / "engine.pid"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as exc:
        read_pid_file(path)
    assert str(path) in str(exc.value)


def test_real_proc_shows_this_process_and_a_child_with_its_visible_devices():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1,0", "SOME_SECRET": "x"}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        reader = ProcReader()
        assert wait_until(lambda: child.pid in reader.tree(os.getpid()))
        me = reader.info(os.getpid())
        assert me.ns_pids[0] == os.getpid() and child.pid in me.children
        assert reader.info(child.pid).cuda_visible_devices == "1,0"
        assert reader.info(child.pid).ppid == os.getpid()
    finally:
        child.kill()
        child.wait(30)
