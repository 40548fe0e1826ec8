"""Checkpoint safety (issue 34 parts 2 and 3): two writers of one folder (a restarted job
overlapping the old one) serialise their saves on the folder's writer lock, and never remove
each other's checkpoints; a second writer waits a bounded time, then raises CheckpointError
naming the holder's host and pid. A save that runs out of disk space raises CheckpointError
saying so, with the bytes it needs and those free; it removes its own partial generation, and
the next save prunes what killed saves left, so a brief disk-full blocks no later save. A load
into other shapes raises an error that is both a CheckpointError and a ShapeError."""

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

import sbpflow as sf
from sbpflow.nn import checkpoint_files as _files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOCK = "writer.lock"


def _fill(m, value: float) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.local.fill_(value)


def _linear(width: int = 4):
    m = sf.nn.Linear(width, width)
    sf.parallel.apply(m, sf.placement("cpu", list(range(sf.world_size()))), {"*": sf.S(0)})
    return m


def _save(path: str, value: float, step: int, width: int = 4, **kw) -> None:
    """In a rank: save a Linear(width, width) whose every value is ``value``."""
    m = _linear(width)
    _fill(m, value)
    sf.save(path, m, step=step, **kw)


def _load(path: str, width: int = 4):
    """In a rank: (step, extra, whether every value equals the step's) or the error's text."""
    m, info = _linear(width), {}
    try:
        step = sf.load(path, m, info=info)
    except sf.CheckpointError as exc:
        return str(exc)
    value = (info["extra"] or {}).get("writer", 0) * 1000 + step
    same = all(bool((p.full_tensor() == value).all()) for p in m.parameters())
    return step, info["extra"], same


def _catching(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the point
        return type(exc).__name__, str(exc)
    return None


def _manifest(path: str) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _generations(path: str) -> list:
    return sorted(n for n in os.listdir(path) if n.startswith("gen-"))


def _wait_for(path: str, proc, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


def _child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.dirname(__file__)])}
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


# -- two writers ----------------------------------------------------------------------------------
_WRITER = r"""
import os, sys, time
import torch
import sbpflow as sf
from test_checkpoint_writers import _fill, _linear

path, writer, saves, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def body():
    m = _linear()
    if sf.rank() == 0:
        open(f"{go}.ready{writer}", "w").close()
    while not os.path.exists(go):
        time.sleep(0.002)
    for step in range(1, saves + 1):
        _fill(m, writer * 1000 + step)
        sf.save(path, m, step=step, extra={"writer": writer})

sf.launch(body, world_size=2, timeout=60)
"""


def _real_failure(path: str, text: str) -> bool:
    """Whether a failed load of ``path`` is a lost checkpoint: the generation it could not
    read is still named by the manifest (or kept as its previous one). A load that two commits
    overtook (its generation is neither) is not: only the newest two are kept."""
    named = re.findall(r"gen-[0-9a-f]{16}", text)
    if not named:
        return True
    m = _manifest(path)
    return named[0] in (m["generation"], m.get("previous"))


@pytest.mark.slow
def test_two_writers_of_one_folder_never_lose_the_committed_checkpoint(tmp_path):
    """Two processes (each a world of 2 rank threads) save 30 times each into one folder
    while this one loads it over and over: every save succeeds and every load gets the whole
    checkpoint the manifest names. Before: one writer's clean-up removed the generation the
    other had just committed (the manifest named a missing generation) or was writing (its
    save failed with FileNotFoundError)."""
    path, go, saves = str(tmp_path / "c"), str(tmp_path / "go"), 30
    sf.launch(_save, world_size=1, args=(path, 0.0, 0))  # the folder always holds one
    writers = [_child(_WRITER, path, w, saves, go) for w in (1, 2)]
    try:
        for w, proc in zip((1, 2), writers):
            _wait_for(f"{go}.ready{w}", proc)
        open(go, "w").close()
        loads, lost = 0, []
        while any(p.poll() is None for p in writers):
            got = sf.launch(_load, world_size=1, args=(path,))[0]
            if isinstance(got, str):
                if _real_failure(path, got):
                    lost.append(got)
            else:
                assert got[2], got  # the values of the step and writer it says
                loads += 1
            time.sleep(0.005)  # leave the writers some of the CPU
        errors = [p.communicate()[1].decode()[-3000:] for p in writers]
    finally:
        for p in writers:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in writers] == [0, 0], errors
    assert lost == [], lost[:3]
    assert loads >= 5, loads
    step, extra, same = sf.launch(_load, world_size=1, args=(path,))[0]
    assert step == saves and same and extra["writer"] in (1, 2)
    # the committed checkpoint and the one it replaced, nothing else
    m = _manifest(path)
    assert _generations(path) == sorted([m["generation"], m["previous"]])


_HOLDER = r"""
import os, sys, time
import sbpflow as sf
from test_checkpoint_writers import _save

path, holding, release = sys.argv[1:4]
real = os.fsync
def fsync(fd):  # the first file written: the save holds the folder's lock
    os.fsync = real
    open(holding, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)
    return real(fd)
os.fsync = fsync
sf.launch(_save, world_size=1, args=(path, 1001.0, 1), kwargs={"extra": {"writer": 1}})
"""


@pytest.mark.slow
def test_a_second_writer_waits_for_the_first_then_names_it_when_it_times_out(tmp_path):
    """Another process is in the middle of a save to the folder: a save with a short
    lock_timeout raises CheckpointError on every rank naming that process's host, pid and the
    lock file, and leaves the folder as it was; with a longer one it waits for that save to
    finish, then commits after it (both checkpoints are whole)."""
    path = str(tmp_path / "c")
    holding, release = str(tmp_path / "holding"), str(tmp_path / "release")
    sf.launch(_save, world_size=2, args=(path, 0.0, 0))
    before = _manifest(path)["generation"]
    holder = _child(_HOLDER, path, holding, release)
    try:
        _wait_for(holding, holder)
        start = time.monotonic()
        got = sf.launch(_catching, world_size=2, timeout=30,
                        args=(_save, path, 2002.0, 2), kwargs={"lock_timeout": 0.5,
                                                                "extra": {"writer": 2}})
        waited = time.monotonic() - start
        assert [g[0] for g in got] == ["CheckpointError"] * 2, got
        msg = got[0][1]
        assert f"pid {holder.pid}" in msg and socket.gethostname() in msg, msg
        assert os.path.join(path, LOCK) in msg and "lock_timeout" in msg, msg
        assert "rank 0" in got[1][1], got[1]
        assert 0.5 <= waited < 10, waited
        assert _manifest(path)["generation"] == before  # nothing committed, nothing removed
        threading.Timer(1.0, lambda: open(release, "w").close()).start()
        start = time.monotonic()
        sf.launch(_save, world_size=2, timeout=60, args=(path, 2002.0, 2),
                  kwargs={"lock_timeout": 20, "extra": {"writer": 2}})
        assert time.monotonic() - start >= 0.8  # it waited for the holder's save
        assert holder.wait(60) == 0, holder.communicate()[1].decode()[-3000:]
    finally:
        open(release, "w").close()
        if holder.poll() is None:
            holder.kill()
    assert sf.launch(_load, world_size=2, args=(path,))[0] == (2, {"writer": 2}, True)
    m = _manifest(path)  # the holder's checkpoint is the one the second save replaced
    with open(os.path.join(path, m["previous"], "rank0.json")) as f:
        assert json.load(f)["entries"]["model/weight"]["shape"] == [4, 4]
    assert _generations(path) == sorted([m["generation"], m["previous"]])


def test_a_lock_timeout_longer_than_the_collective_timeout_is_refused(tmp_path):
    """The other ranks wait for the lock inside a collective: a lock_timeout they would not
    outlast is refused on every rank, naming both timeouts, before anything is written."""
    path = str(tmp_path / "c")
    got = sf.launch(_catching, world_size=2, timeout=10, args=(_save, path, 1.0, 1),
                    kwargs={"lock_timeout": 60})
    assert [g[0] for g in got] == ["CheckpointError"] * 2, got
    assert all("lock_timeout" in g[1] and "SBPFLOW_TIMEOUT" in g[1] for g in got), got
    assert not os.path.exists(os.path.join(path, "manifest.json"))


# -- disk full ------------------------------------------------------------------------------------
class _Disk:
    """A file system of ``capacity`` bytes holding everything under ``root``: a write past it
    writes what fits and fails with ENOSPC (a full disk's error), ``statvfs`` reports what is
    left. Installed over checkpoint_files' ``open`` (the checkpoint's writes) and
    ``os.statvfs``."""

    def __init__(self, root: str, capacity: int) -> None:
        self.root, self.capacity = root, capacity
        self._statvfs = os.statvfs

    def used(self) -> int:
        return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(self.root)
                   for n in names)

    def open(self, path, mode="r", *args, **kwargs):
        if "r" in mode and "+" not in mode:
            return open(path, mode, *args, **kwargs)
        return _FullFile(self, open(path, mode, buffering=0))

    def statvfs(self, path):
        if not os.path.abspath(path).startswith(self.root):
            return self._statvfs(path)
        return os.statvfs_result((4096, 1, self.capacity, self.capacity - self.used(),
                                  self.capacity - self.used(), 1000, 1000, 1000, 0, 255))


class _FullFile:
    """An unbuffered file of a `_Disk` (its size on disk is what was written)."""

    def __init__(self, disk: _Disk, f) -> None:
        self._disk, self._f = disk, f

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        room = self._disk.capacity - self._disk.used()
        if len(data) > room:
            self._f.write(data[:max(room, 0)])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _generation_bytes(path: str) -> int:
    gen = os.path.join(path, _manifest(path)["generation"])
    return sum(os.path.getsize(os.path.join(gen, n)) for n in os.listdir(gen))


def _numbers(msg: str) -> tuple[int, int]:
    """The bytes a disk-full message says the save needs and the bytes free."""
    need = re.search(r"needs about (\d+) bytes", msg)
    free = re.search(r"(\d+) bytes (?:are|were) free", msg)
    assert need and free, msg
    return int(need.group(1)), int(free.group(1))


def test_a_save_that_runs_out_of_disk_space_says_so_and_leaves_nothing(tmp_path, monkeypatch):
    """The disk fills during a save: CheckpointError on every rank saying the disk is full,
    the bytes the save needs and those that were free; the partial generation is removed, the
    committed checkpoint loads. Once space is freed, a leftover of a killed save does not take
    it: the next save prunes it before writing, and succeeds. Before: torch's zip writer's
    RuntimeError ('unexpected pos ...', no word of disk space), a partial generation left by
    every failed save, and every later save failing on a disk those filled."""
    path, width = str(tmp_path / "c"), 64
    sf.launch(_save, world_size=2, args=(path, 1.0, 1, width))
    size = _generation_bytes(path)
    disk = _Disk(str(tmp_path), 0)
    monkeypatch.setattr(_files, "open", disk.open, raising=False)
    monkeypatch.setattr(os, "statvfs", disk.statvfs)
    for attempt in range(2):  # a failed save leaves nothing that makes the next one fail
        disk.capacity = disk.used() + size // 2
        free = disk.capacity - disk.used()
        got = sf.launch(_catching, world_size=2, timeout=30, args=(_save, path, 2.0, 2, width))
        assert [g[0] for g in got] == ["CheckpointError"] * 2, got
        full = [msg for _, msg in got if "out of disk space" in msg]
        assert len(full) == 2, got  # the rank that ran out, and the others naming it
        need, said_free = _numbers(full[0])
        assert free - 256 <= said_free <= free, (said_free, free)  # less the lock's name
        assert size * 0.8 < need < size * 1.5, (need, size, full[0])
        assert path in full[0] and "No space left on device" in full[0], full[0]
        assert _generations(path) == [_manifest(path)["generation"]], attempt
        assert sf.launch(_load, world_size=2, args=(path, width))[0] == (1, None, True)
    # a killed save's leftover; room for one more generation only once it is removed
    shutil.copytree(os.path.join(path, _manifest(path)["generation"]),
                    os.path.join(path, _files.generation_name(12345)))
    disk.capacity = disk.used() + size // 2
    sf.launch(_save, world_size=2, timeout=30, args=(path, 3.0, 3, width))
    assert sf.launch(_load, world_size=2, args=(path, width))[0] == (3, None, True)
    m = _manifest(path)
    assert _generations(path) == sorted([m["generation"], m["previous"]])


def _mount_tmpfs(where: str, size: str) -> None:
    os.makedirs(where)
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where],
                              capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")


def test_a_brief_disk_full_on_a_real_small_tmpfs_blocks_no_later_save(tmp_path):
    """On a real 2 MiB tmpfs (skipped where mount is not permitted): a save that fills the
    disk raises CheckpointError saying so and leaves no partial generation; once the space is
    freed the next saves succeed. Before: the same saves kept failing with ENOSPC, each
    leaving one more partial generation."""
    mnt = str(tmp_path / "mnt")
    _mount_tmpfs(mnt, "2m")
    try:
        path, width = os.path.join(mnt, "c"), 256  # a generation of about 260 kB
        sf.launch(_save, world_size=2, args=(path, 1.0, 1, width))
        sf.launch(_save, world_size=2, args=(path, 2.0, 2, width))
        size = _generation_bytes(path)
        st = os.statvfs(mnt)
        filler = os.path.join(mnt, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * (st.f_bavail * st.f_frsize - size // 2))
        for step in (3, 4):
            got = sf.launch(_catching, world_size=2, timeout=30,
                            args=(_save, path, float(step), step, width))
            assert [g[0] for g in got] == ["CheckpointError"] * 2, got
            assert all("out of disk space" in g[1] for g in got), got
            need, free = _numbers(got[0][1])
            assert need > free and need > size * 0.8, got[0][1]
            assert len(_generations(path)) == 2  # the committed one and the one before it
            assert sf.launch(_load, world_size=2, args=(path, width))[0] == (2, None, True)
        os.remove(filler)
        for step in (5, 6):
            sf.launch(_save, world_size=2, timeout=30, args=(path, float(step), step, width))
            assert sf.launch(_load, world_size=2, args=(path, width))[0] == (step, None, True)
            assert len(_generations(path)) == 2
    finally:
        subprocess.run(["umount", mnt], capture_output=True, timeout=20)


# -- shapes ---------------------------------------------------------------------------------------
def test_a_load_into_other_shapes_raises_a_checkpoint_error_that_is_a_shape_error(tmp_path):
    """sf.load's docstring promises CheckpointError for a checkpoint that does not fit; a shape
    mismatch is also a ShapeError (as everywhere else): the error is both, and names the
    tensor, the saved and the expected shapes. Before: a ShapeError only."""
    path = str(tmp_path / "c")
    sf.launch(_save, world_size=2, args=(path, 1.0, 1, 4))
    got = sf.launch(_catching, world_size=2, args=(_load_strict, path, 6))
    assert [g[0] for g in got] == ["CheckpointShapeError"] * 2, got
    assert "'weight'" in got[0][1] and "(4, 4)" in got[0][1] and "(6, 6)" in got[0][1], got
    assert issubclass(_files.CheckpointShapeError, sf.CheckpointError)
    assert issubclass(_files.CheckpointShapeError, sf.ShapeError)


def _load_strict(path: str, width: int) -> None:
    sf.load(path, _linear(width))
