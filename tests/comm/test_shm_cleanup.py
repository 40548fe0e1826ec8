"""The shared-memory rings of the torch backend's message channels (sbpflow/comm/shm_ring.py)
leave nothing in /dev/shm on any exit path: a normal end, an exception on one rank, a rank
killed, a collective timeout, the launcher itself killed. Each run first moves a 1 MiB tensor
through a ring (the ranks check they map it)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from shm_fns import ring_then
from sbpflow.comm import launch
from sbpflow.errors import CommError

SHM = "/dev/shm"
HERE = os.path.dirname(os.path.abspath(__file__))


def _left(before: set) -> set:
    """Entries of /dev/shm that are new since ``before`` and still there a moment later."""
    new = set(os.listdir(SHM)) - before
    if new:
        time.sleep(1.0)  # (another process's short-lived entry is gone by then)
        new &= set(os.listdir(SHM))
    return new


@pytest.mark.gloo
@pytest.mark.parametrize("how", ["ok", "raise", "kill", "timeout"])
def test_no_shm_entry_is_left_after_a_run_however_it_ends(how):
    before = set(os.listdir(SHM))
    if how == "ok":
        assert launch(ring_then, 2, backend="torch", args=(how,)) == [True, True]
    else:
        expected = {"raise": ValueError, "kill": CommError, "timeout": CommError}[how]
        with pytest.raises(expected) as info:
            launch(ring_then, 2, backend="torch", args=(how,), timeout=3.0)
        assert "rank 1" in str(info.value) + "".join(getattr(info.value, "__notes__", []))
    assert _left(before) == set()


_LAUNCHER = """
import sys
sys.path[:0] = {path!r}
from shm_fns import ring_then_wait
from sbpflow.comm import launch
if __name__ == "__main__":
    launch(ring_then_wait, 2, backend="torch", args=({marker!r},))
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.gloo
def test_no_shm_entry_is_left_after_the_launcher_is_killed(tmp_path):
    before = set(os.listdir(SHM))
    marker = str(tmp_path / "rank")
    script = tmp_path / "launcher.py"
    script.write_text(_LAUNCHER.format(path=[HERE, *sys.path], marker=marker))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{marker}.{r}") for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks never ran"
            time.sleep(0.1)
        time.sleep(0.2)  # (the files are written whole)
        ranks = [open(f"{marker}.{r}").read().split() for r in (0, 1)]
        assert [m for _, m in ranks] == ["1", "1"]  # both map the ring
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 20  # the ranks end with their launcher
        while not all(_gone(int(pid)) for pid, _ in ranks):
            assert time.monotonic() < deadline, "the rank processes outlived their launcher"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _left(before) == set()
