"""Checkpoint faults (issue 12 parts 2 and 3): a save killed at any moment leaves the previous
checkpoint loadable and equal, or the new one; leftovers are removed by the next save; any damage
to any file raises CheckpointError on every rank, naming the file; optimizer state does not load
into another optimizer class."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import zlib

import pytest
import torch

import sbpflow as sf
from sbpflow.optim.optimizer import state_like
from nn_twin import OPTIMIZERS, layout, sf_mlp, sf_train

WORLD = 2


def _expected(step: int) -> dict:
    """The logical values saved at ``step``: every parameter and momentum buffer distinct,
    elementwise and from one step to the next."""
    sf.manual_seed(0)
    shapes = sf.launch(lambda: {n: tuple(p.shape) for n, p in sf_mlp().named_parameters()},
                       world_size=1)[0]
    out = {}
    for i, (n, shape) in enumerate(shapes.items()):
        base = torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)
        out[n] = base / 7 + 100 * step + i
        out[f"{n}/momentum"] = -base / 3 - 100 * step - i
    return out


def _build():
    """In a rank: the MLP split over the world (every rank writes its own pieces) and an SGD
    with momentum."""
    m = sf_mlp()
    sf.parallel.apply(m, sf.placement("cpu", list(range(WORLD))), {"*": sf.S(0)})
    return m, sf.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _save_values(path: str, step: int, values: dict) -> None:
    """In a rank: set the model and optimizer to ``values`` and save them as ``step``."""
    m, opt = _build()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.local.copy_(sf.tensor(values[n], p.placement, p.sbp).local)
            buf = state_like(p)
            buf.local.copy_(sf.tensor(values[f"{n}/momentum"], p.placement, p.sbp).local)
            opt.state[p]["momentum_buffer"] = buf
    sf.save(path, m, opt, step=step)


def _load_values(path: str):
    """In a rank: load into a fresh model and SGD; the step and the logical values."""
    m, opt = _build()
    step = sf.load(path, m, opt)
    out = {n: p.full_tensor() for n, p in m.named_parameters()}
    out.update({f"{n}/momentum": opt.state[p]["momentum_buffer"].full_tensor()
                for n, p in m.named_parameters()})
    return step, out


def _catching(fn, *args):
    """In a rank: run ``fn`` and return ``(exception class name, message)`` or None."""
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the point
        return type(exc).__name__, str(exc)
    return None


def _assert_holds(path: str, step: int | None, expected: dict) -> int:
    """The folder loads as the checkpoint of ``step`` (None: of the step it says); returns
    the step."""
    got_step, got = sf.launch(_load_values, world_size=WORLD, args=(path,))[0]
    step = got_step if step is None else step
    assert got_step == step
    assert set(got) == set(expected[step])
    for k, v in expected[step].items():
        assert torch.equal(got[k], v), k
    return step


def _listing(path: str) -> list:
    return sorted(os.listdir(path))


def _generation(path: str) -> str:
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)["generation"]


@pytest.fixture(scope="module")
def expected():
    return {s: _expected(s) for s in (1, 2, 3)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, expected):
    """A folder holding the checkpoint of step 1 (copied by the tests that change it)."""
    path = str(tmp_path_factory.mktemp("ckpt") / "step1")
    sf.launch(_save_values, world_size=WORLD, args=(path, 1, expected[1]))
    return path


# -- atomic saves ---------------------------------------------------------------------------------
class _Died(BaseException):
    """The simulated SIGKILL: a BaseException, so no ``except Exception`` of the save sees it."""


_FS_OPS = [(os, "mkdir"), (os, "fsync"), (os, "replace"), (os, "rename"), (os, "remove"),
           (os, "unlink"), (os, "rmdir")]


@contextlib.contextmanager
def _killed_at(k: int):
    """The whole job dies at its ``k``-th file-system operation (mkdir, fsync, rename,
    remove): that one and every later one, on any rank thread, raise `_Died` and do nothing,
    so the disk keeps exactly what a SIGKILL at that instant would leave. Yields a list that
    holds True once the job died."""
    lock, count, dead = threading.Lock(), [0], [False]

    def wrap(fn):
        def op(*args, **kwargs):
            with lock:
                count[0] += 1
                dead[0] = dead[0] or count[0] >= k
                if dead[0]:
                    raise _Died(f"killed at file-system operation {k}")
            return fn(*args, **kwargs)
        return op

    real = [(mod, name, getattr(mod, name)) for mod, name in _FS_OPS]
    for mod, name, fn in real:
        setattr(mod, name, wrap(fn))
    try:
        yield dead
    finally:
        for mod, name, fn in real:
            setattr(mod, name, fn)


def test_a_save_killed_at_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path, saved,
                                                                      expected):
    """Kill the save of step 2 over the checkpoint of step 1 at each of its file-system
    operations in turn: the folder always loads, as step 1 until the commit and as step 2
    after; the next save removes whatever the killed one left."""
    outcomes, killed = [], []
    for k in range(1, 200):
        path = str(tmp_path / f"k{k}")
        shutil.copytree(saved, path)
        with _killed_at(k) as dead:
            try:
                sf.launch(_save_values, world_size=WORLD, args=(path, 2, expected[2]))
            except _Died:
                pass
        if not dead[0]:
            break  # the save has fewer operations than k: it completed
        step = _assert_holds(path, None, expected)
        assert step in (1, 2), (k, step)
        outcomes.append(step)
        killed.append(path)
    _assert_holds(path, 2, expected)
    # killed before the commit: the old checkpoint; after it: the new one
    assert outcomes == sorted(outcomes) and outcomes[0] == 1 and 2 in outcomes, outcomes
    for path in killed:  # the next save leaves its own files and the previous checkpoint's
        before = _generation(path)
        sf.launch(_save_values, world_size=WORLD, args=(path, 3, expected[3]))
        assert _listing(path) == sorted([before, _generation(path), "manifest.json"]), path
        _assert_holds(path, 3, expected)


def test_leftovers_of_killed_saves_are_removed_by_the_next_save(tmp_path, saved, expected):
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    for i, k in enumerate((3, 6)):  # two saves killed while writing their files
        with _killed_at(k), contextlib.suppress(_Died):
            sf.launch(_save_values, world_size=WORLD, args=(path, 2, expected[2]))
        leftovers = [n for n in _listing(path) if n not in (_generation(path), "manifest.json")]
        # the killed saves' generations (the ranks' file operations interleave, so where k
        # falls varies: a save killed at its first mkdir leaves nothing)
        assert 1 <= len(leftovers) <= i + 1 and all(n.startswith("gen-") for n in leftovers)
        _assert_holds(path, 1, expected)
    first = _generation(path)
    sf.launch(_save_values, world_size=WORLD, args=(path, 2, expected[2]))
    # the killed saves' leftovers are gone; step 1's generation stays until the next save
    assert _listing(path) == sorted([first, _generation(path), "manifest.json"])
    assert sorted(os.listdir(os.path.join(path, _generation(path)))) == \
        ["common.pt"] + [f"rank{r}.{e}" for r in range(WORLD) for e in ("json", "pt")]
    _assert_holds(path, 2, expected)


def test_a_rank_failing_to_write_fails_the_save_on_every_rank(tmp_path, saved, expected,
                                                             monkeypatch):
    """Rank 1's disk is full: every rank raises CheckpointError (none waits for the others),
    and the folder still holds step 1."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    real = os.fsync

    def fsync(fd):
        if threading.current_thread().name == "sbpflow-rank1":
            raise OSError(28, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    got = sf.launch(_catching, world_size=WORLD, timeout=20,
                    args=(_save_values, path, 2, expected[2]))
    monkeypatch.undo()
    assert [g[0] for g in got] == ["CheckpointError"] * WORLD, got
    assert "No space left on device" in got[1][1]
    assert "rank 1" in got[0][1] and "No space left on device" in got[0][1]
    _assert_holds(path, 1, expected)


_CHILD = r"""
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
from test_checkpoint_faults import WORLD, _expected, _save_values
import sbpflow as sf

path, kill_at = sys.argv[1], int(sys.argv[2])
sf.launch(_save_values, world_size=WORLD, args=(path, 1, _expected(1)))
values = _expected(2)
count = [0]
real = os.fsync
def fsync(fd):
    count[0] += 1
    if count[0] == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd)
os.fsync = fsync
sf.launch(_save_values, world_size=WORLD, args=(path, 2, values))
"""


@pytest.mark.slow
def test_a_real_sigkill_during_a_save_keeps_the_previous_checkpoint(tmp_path, expected):
    """A process SIGKILLed while its save writes the rank files (no cleanup code runs)."""
    path = str(tmp_path / "c")
    code = _CHILD.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", code, path, "3"], capture_output=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    _assert_holds(path, 1, expected)


# -- corruption -----------------------------------------------------------------------------------
def _find(path: str, name: str) -> str:
    for root, _, files in os.walk(path):
        if name in files:
            return os.path.join(root, name)
    raise AssertionError(f"no {name} in {path}")


def _flip(where: float):
    def damage(p):
        with open(p, "r+b") as f:
            n = f.seek(0, 2)
            f.seek(min(int(n * where), n - 1))
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    return damage


def _truncate(p):
    os.truncate(p, os.path.getsize(p) // 2)


def _drop_last_byte(p):
    os.truncate(p, os.path.getsize(p) - 1)


def _append(p):
    with open(p, "ab") as f:
        f.write(b"\x00garbage\n")


def _write(text: str):
    def damage(p):
        with open(p, "w") as f:
            f.write(text)
    return damage


def _manifest_field(key: str, value):
    """Set a manifest field to ``value`` and re-seal the manifest (its checksum valid), as a
    buggy or foreign writer would: only the schema check can tell."""
    def damage(p):
        from sbpflow.nn.checkpoint_files import encode_manifest
        with open(p) as f:
            m = json.load(f)
        m.pop("crc32", None)
        m[key] = value
        with open(p, "wb") as f:
            f.write(encode_manifest(m))
    return damage


def _rank_index_entry_box(p):
    """Give a shard of rank 0's index a box of the wrong type, and re-seal the file's record
    in the manifest: only the index's schema check can tell."""
    from sbpflow.nn.checkpoint_files import encode_manifest
    with open(p) as f:
        meta = json.load(f)
    next(iter(meta["entries"].values()))["box"] = "everything"
    data = json.dumps(meta).encode()
    with open(p, "wb") as f:
        f.write(data)
    mpath = os.path.join(os.path.dirname(os.path.dirname(p)), "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m.pop("crc32")
    m["files"]["rank0.json"] = {"size": len(data), "crc32": zlib.crc32(data)}
    with open(mpath, "wb") as f:
        f.write(encode_manifest(m))


FILES = ["manifest.json", "common.pt", "rank0.pt", "rank1.pt", "rank0.json", "rank1.json"]
DAMAGE = {"flip-first-byte": _flip(0.0), "flip-middle-byte": _flip(0.5),
          "flip-last-byte": _flip(1.0), "truncate-half": _truncate,
          "drop-last-byte": _drop_last_byte, "append-garbage": _append, "delete": os.remove}
CASES = [(f, d) for f in FILES for d in DAMAGE] + [
    ("manifest.json", "bad-json"), ("manifest.json", "empty"),
    ("manifest.json", "world_size-is-a-string"), ("manifest.json", "tensors-is-a-list"),
    ("manifest.json", "generation-elsewhere"), ("rank0.json", "box-is-a-string")]
SPECIAL = {"bad-json": _write('{"format": 2, "save_id": '), "empty": _write(""),
           "world_size-is-a-string": _manifest_field("world_size", "2"),
           "tensors-is-a-list": _manifest_field("tensors", []),
           "generation-elsewhere": _manifest_field("generation", "../../etc"),
           "box-is-a-string": _rank_index_entry_box}


@pytest.mark.parametrize("name,damage", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_any_damage_raises_checkpoint_error_on_every_rank(tmp_path, saved, name, damage):
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    (DAMAGE.get(damage) or SPECIAL[damage])(_find(path, name))
    got = sf.launch(_catching, world_size=WORLD, timeout=20, args=(_load_values, path))
    for r, g in enumerate(got):
        assert g is not None and g[0] == "CheckpointError", (r, g)
        assert name in g[1], (r, g)  # names the damaged file


def test_damage_is_found_before_the_model_changes(tmp_path, saved, expected):
    """A load that fails leaves the model and optimizer as they were (every check runs
    before the first write): rank 0's shards are damaged, which rank 1 neither reads nor
    verifies (it learns of the damage from rank 0)."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    _flip(0.5)(_find(path, "rank0.pt"))

    def body():
        m, opt = _build()
        before = {n: p.full_tensor() for n, p in m.named_parameters()}
        err = _catching(sf.load, path, m, opt)
        after = {n: p.full_tensor() for n, p in m.named_parameters()}
        return err, all(torch.equal(before[n], after[n]) for n in before), dict(opt.state)

    for err, unchanged, state in sf.launch(body, world_size=WORLD):
        assert err[0] == "CheckpointError" and "rank0.pt" in err[1]
        assert unchanged and state == {}


def _gloo_load(path):
    """Runs in each gloo process."""
    return _catching(_load_values, path)


@pytest.mark.gloo
def test_damage_raises_on_every_process_over_gloo(tmp_path, saved):
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    _flip(0.5)(_find(path, "rank0.pt"))  # found by rank 0 only
    got = sf.launch(_gloo_load, world_size=WORLD, backend="torch", timeout=60, args=(path,))
    for g in got:
        assert g is not None and g[0] == "CheckpointError" and "rank0.pt" in g[1], g


# -- optimizer classes ----------------------------------------------------------------------------
def _train_and_save(path: str, opt_name: str) -> None:
    sf.manual_seed(0)
    m = sf_mlp()
    pl, x_sbp, rules = layout("zero")
    sf.parallel.apply(m, pl, rules)
    opt = OPTIMIZERS[opt_name][0](m.parameters())
    sf_train(m, opt, pl, x_sbp, 1)
    sf.save(path, m, opt, step=1)


def _load_into(path: str, opt_name: str):
    m = sf_mlp()
    pl, _, rules = layout("zero")
    sf.parallel.apply(m, pl, rules)
    return _catching(sf.load, path, m, OPTIMIZERS[opt_name][0](m.parameters()))


@pytest.mark.parametrize("saved_with,loaded_into,names", [
    ("adamw", "sgd", ("AdamW", "SGD")), ("sgd", "adam", ("SGD", "Adam")),
    ("adamw", "adam", ("AdamW", "Adam"))])
def test_optimizer_state_does_not_load_into_another_class(tmp_path, saved_with, loaded_into,
                                                          names):
    path = str(tmp_path / "c")
    sf.launch(_train_and_save, world_size=4, args=(path, saved_with))
    for err in sf.launch(_load_into, world_size=4, args=(path, loaded_into)):
        assert err is not None and err[0] == "CheckpointError", err
        assert f"a {names[0]} optimizer" in err[1] and f"into a {names[1]}" in err[1]
    assert sf.launch(_load_into, world_size=4, args=(path, saved_with)) == [None] * 4


def test_optimizer_state_dict_names_its_class():
    def body():
        sf.manual_seed(0)
        m = sf_mlp()
        pl, x_sbp, rules = layout("dp")
        sf.parallel.apply(m, pl, rules)
        opt = OPTIMIZERS["adamw"][0](m.parameters())
        sf_train(m, opt, pl, x_sbp, 1)
        sd = opt.state_dict()
        sgd = OPTIMIZERS["sgd"][0](m.parameters())
        err = _catching(sgd.load_state_dict, sd)
        OPTIMIZERS["adamw"][0](m.parameters()).load_state_dict(sd)  # its own class loads
        return sd["class"], err, sgd.state

    cls, err, sgd_state = sf.launch(body, world_size=4)[0]
    assert cls == "AdamW" and len(sgd_state) == 0
    assert err[0] == "CheckpointError" and "AdamW" in err[1] and "SGD" in err[1]
