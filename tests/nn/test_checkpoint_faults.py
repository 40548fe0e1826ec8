"""Checkpoint faults (issue 12 parts 2 and 3): a save killed at any moment leaves the previous
checkpoint loadable and equal, or the new one; leftovers are removed by the next save; any damage
to any file raises CheckpointError on every rank, naming the file; optimizer state does not load
into another optimizer class. Then the review's findings: a save committing during a load, a
load failing after the ranks agreed, bad ``extra`` and commit errors, ranks saving different
tensors, a resharding load reading every file once per rank, the cleaning holding up a save."""

import builtins
import contextlib
import io
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
from checkpoint_damage import FILE_DAMAGE, flip, overwrite
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


def _failed_load(path: str):
    """Rank function: load ``path`` into a fresh model; (the error caught, whether the
    parameters are unchanged, the optimizer state)."""
    m, opt = _build()
    before = {n: p.full_tensor() for n, p in m.named_parameters()}
    err = _catching(sf.load, path, m, opt)
    after = {n: p.full_tensor() for n, p in m.named_parameters()}
    return err, all(torch.equal(before[n], after[n]) for n in before), dict(opt.state)


def _listing(path: str) -> list:
    """The folder's entries but its writer lock's files (they stay, see checkpoint_files)."""
    return sorted(n for n in os.listdir(path) if n not in ("writer.lock", "writer.wait"))


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
DAMAGE = FILE_DAMAGE
CASES = [(f, d) for f in FILES for d in DAMAGE] + [
    ("manifest.json", "bad-json"), ("manifest.json", "empty"),
    ("manifest.json", "world_size-is-a-string"), ("manifest.json", "tensors-is-a-list"),
    ("manifest.json", "generation-elsewhere"), ("rank0.json", "box-is-a-string")]
SPECIAL = {"bad-json": overwrite(b'{"format": 2, "save_id": '), "empty": overwrite(b""),
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
    flip(0.5)(_find(path, "rank0.pt"))

    for err, unchanged, state in sf.launch(_failed_load, args=(path,), world_size=WORLD):
        assert err[0] == "CheckpointError" and "rank0.pt" in err[1]
        assert unchanged and state == {}


def _gloo_load(path):
    """Runs in each gloo process."""
    return _catching(_load_values, path)


@pytest.mark.gloo
def test_damage_raises_on_every_process_over_gloo(tmp_path, saved):
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    flip(0.5)(_find(path, "rank0.pt"))  # found by rank 0 only
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


# -- review findings ------------------------------------------------------------------------------
def _reseal(path: str, names: list) -> None:
    """Record the current size and crc32 of ``names`` (files of the committed generation) in
    the manifest and re-seal it, as a writer that meant them would."""
    from sbpflow.nn.checkpoint_files import encode_manifest
    mpath = os.path.join(path, "manifest.json")
    with open(mpath) as f:
        m = json.load(f)
    m.pop("crc32")
    for name in names:
        with open(os.path.join(path, m["generation"], name), "rb") as f:
            data = f.read()
        m["files"][name] = {"size": len(data), "crc32": zlib.crc32(data)}
    with open(mpath, "wb") as f:
        f.write(encode_manifest(m))


def test_every_rank_loads_one_checkpoint_when_a_save_commits_during_the_load(
        tmp_path, saved, expected, monkeypatch):
    """The manifest is replaced (step 2 committed) right after its first read: every rank still
    loads the same checkpoint, whole (rank 0 reads the manifest for all of them)."""
    path, other = str(tmp_path / "c"), str(tmp_path / "other")
    shutil.copytree(saved, path)
    sf.launch(_save_values, world_size=WORLD, args=(other, 2, expected[2]))
    shutil.copytree(os.path.join(other, _generation(other)),
                    os.path.join(path, _generation(other)))
    shutil.copyfile(os.path.join(other, "manifest.json"), os.path.join(path, "manifest.next"))
    target, real_open = os.path.join(path, "manifest.json"), builtins.open
    lock, reads = threading.Lock(), []

    def spying_open(file, mode="r", *args, **kwargs):
        if mode != "rb" or not isinstance(file, str) or os.path.abspath(file) != target:
            return real_open(file, mode, *args, **kwargs)
        with lock:  # the read, then the commit, before any other rank reads
            with real_open(file, mode) as f:
                data = f.read()
            if not reads:
                os.replace(os.path.join(path, "manifest.next"), target)
            reads.append(threading.current_thread().name)
        return io.BytesIO(data)

    monkeypatch.setattr(builtins, "open", spying_open)
    got = sf.launch(_load_values, world_size=WORLD, timeout=30, args=(path,))
    monkeypatch.undo()
    assert reads and _generation(path) == _generation(other)  # the commit did happen
    steps = [step for step, _ in got]
    assert steps == [1] * WORLD, steps  # the checkpoint named when the load began
    for k, v in expected[1].items():
        assert torch.equal(got[0][1][k], v), k
    _assert_holds(path, 2, expected)  # and the next load, the new one


def test_a_save_keeps_the_previous_checkpoint_until_the_next_save(tmp_path, saved, expected):
    """After a commit the folder holds the new generation and the previous one (a load that
    read the old manifest can finish); the next save removes the older."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    gens = [_generation(path)]
    for step in (2, 3):
        sf.launch(_save_values, world_size=WORLD, args=(path, step, expected[step]))
        gens.append(_generation(path))
        assert _listing(path) == sorted(gens[-2:] + ["manifest.json"])
        with open(os.path.join(path, "manifest.json")) as f:
            assert json.load(f)["previous"] == gens[-2]
        _assert_holds(path, step, expected)


def test_pieces_that_do_not_cover_a_region_fail_the_load_before_any_change(tmp_path, saved):
    """Rank 1's index and shards lose one tensor (consistently, re-sealed): the pieces no
    longer cover what rank 1 reads. Found while planning, before the agreement: every rank
    raises CheckpointError (none waits in a collective) and nothing is changed."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    gen = os.path.join(path, _generation(path))
    with open(os.path.join(gen, "rank1.json")) as f:
        index = json.load(f)
    key = sorted(index["entries"])[-1]
    del index["entries"][key]
    with open(os.path.join(gen, "rank1.json"), "w") as f:
        json.dump(index, f)
    shards = torch.load(os.path.join(gen, "rank1.pt"), weights_only=True)
    del shards["tensors"][key]
    torch.save(shards, os.path.join(gen, "rank1.pt"))
    _reseal(path, ["rank1.json", "rank1.pt"])

    for err, unchanged, state in sf.launch(_failed_load, args=(path,), world_size=WORLD,
                                           timeout=20):
        assert err[0] == "CheckpointError" and key in err[1] and "cover" in err[1], err
        assert unchanged and state == {}


def test_extra_the_manifest_cannot_hold_fails_the_save_before_any_write(tmp_path, saved,
                                                                       expected):
    """``{1: "a", "b": 2}`` passes json.dumps but not the manifest's sorted encoding: every rank
    raises CheckpointError at once, nothing is written."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)

    def body():
        m, opt = _build()
        return _catching(sf.save, path, m, opt, 2, {1: "a", "b": 2})

    got = sf.launch(body, world_size=WORLD, timeout=20)
    assert [g[0] for g in got] == ["CheckpointError"] * WORLD, got
    assert all("extra" in g[1] for g in got), got  # each rank checked its own
    assert _listing(path) == [_generation(path), "manifest.json"]
    _assert_holds(path, 1, expected)


def test_a_failing_commit_raises_checkpoint_error_on_every_rank(tmp_path, saved, expected,
                                                               monkeypatch):
    """Rank 0 cannot rename the new manifest into place: CheckpointError on every rank (rank
    0's wraps the OSError), the folder still holds step 1."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    real = os.replace

    def replace(src, dst, *args, **kwargs):
        if str(dst).endswith("manifest.json"):
            raise OSError(5, "Input/output error")
        return real(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    got = sf.launch(_catching, world_size=WORLD, timeout=20,
                    args=(_save_values, path, 2, expected[2]))
    monkeypatch.undo()
    assert [g[0] for g in got] == ["CheckpointError"] * WORLD, got
    assert all("commit" in g[1] and "Input/output error" in g[1] for g in got), got
    _assert_holds(path, 1, expected)


def _rank_dependent_save(path: str, grow: int):
    """In a rank: save nn.Linear(4, 4 + grow * rank) split by rows; the error or None."""
    m = sf.nn.Linear(4, 4 + grow * sf.rank())
    sf.parallel.apply(m, sf.placement("cpu", [0, 1]), {"*": sf.S(0)})
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.local.fill_(float(i + grow))
    return _catching(sf.save, path, m)


def _linear_values(path: str):
    m = sf.nn.Linear(4, 4)
    sf.parallel.apply(m, sf.placement("cpu", [0, 1]), {"*": sf.S(0)})
    sf.load(path, m)
    return m.weight.full_tensor(), m.bias.full_tensor()


def test_ranks_saving_different_tensors_fail_the_save_before_any_write(tmp_path):
    """Rank r saves nn.Linear(4, 4 + 2r): only rank 0's tensors would be described, the
    checkpoint unloadable. Every rank raises CheckpointError naming rank 1, nothing is
    written, the previous checkpoint stays."""
    path = str(tmp_path / "c")
    assert sf.launch(_rank_dependent_save, world_size=2, args=(path, 0)) == [None, None]
    listing = _listing(path)
    got = sf.launch(_rank_dependent_save, world_size=2, timeout=20, args=(path, 2))
    for g in got:
        assert g is not None and g[0] == "CheckpointError" and "rank(s) [1]" in g[1], got
    assert _listing(path) == listing
    weight, bias = sf.launch(_linear_values, world_size=2, args=(path,))[0]
    assert torch.equal(weight, torch.zeros(4, 4)) and torch.equal(bias, torch.ones(4))


def _rchar() -> int:
    """Bytes this thread has read with read() calls (Linux)."""
    with open("/proc/thread-self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def _resharded_load_reads(path: str) -> int:
    m = sf.nn.Linear(512, 512)
    sf.parallel.apply(m, sf.placement("cpu", [0, 1, 2, 3]), {"weight": sf.S(1), "*": sf.S(0)})
    sf.load(path, m, restore_rng=False)  # warm: lazy imports, caches
    start = _rchar()
    sf.load(path, m, restore_rng=False)
    return _rchar() - start


@pytest.mark.skipif(not os.path.exists("/proc/thread-self/io"), reason="needs Linux /proc")
def test_a_resharding_load_reads_each_file_once(tmp_path):
    """4 ranks save a 512x512 weight split by rows and load it split by columns: every rank
    needs a piece of every rank's file, but each file is read whole (its checksum) by one rank
    only, the pieces are memory-mapped. Before: every rank read every file whole."""
    path = str(tmp_path / "c")

    def save():
        m = sf.nn.Linear(512, 512)
        sf.parallel.apply(m, sf.placement("cpu", [0, 1, 2, 3]), {"*": sf.S(0)})
        sf.save(path, m)

    sf.launch(save, world_size=4)
    gen = os.path.join(path, _generation(path))
    size = sum(os.path.getsize(os.path.join(gen, n)) for n in os.listdir(gen))
    reads = sf.launch(_resharded_load_reads, world_size=4, args=(path,))
    # each rank: its quarter of the data, the small indexes and torch.load's headers
    assert all(r < size / 4 + 256_000 for r in reads), (reads, size)
    assert sum(reads) < 1.5 * size, (reads, size)


def test_removing_old_generations_holds_up_no_rank(tmp_path, saved, expected, monkeypatch):
    """Rank 0 removes the generation before the previous one after the save's last agreement:
    on a slow file system, rank 1 has returned from sf.save while rank 0 still removes."""
    path = str(tmp_path / "c")
    shutil.copytree(saved, path)
    sf.launch(_save_values, world_size=WORLD, args=(path, 2, expected[2]))
    returned, waited, real = threading.Event(), [], shutil.rmtree

    def slow_rmtree(p, *args, **kwargs):
        if threading.current_thread().name == "sbpflow-rank0":
            waited.append(returned.wait(5))  # did rank 1 return before the removal ended?
        return real(p, *args, **kwargs)

    def body():
        _save_values(path, 3, expected[3])
        if sf.rank() == 1:
            returned.set()

    monkeypatch.setattr(shutil, "rmtree", slow_rmtree)
    sf.launch(_catching, world_size=WORLD, timeout=30, args=(body,))
    monkeypatch.undo()
    assert waited == [True], waited  # one generation removed (step 1's), no rank held up
    _assert_holds(path, 3, expected)


def test_objects_that_are_not_sbpflow_ones_are_refused_naming_the_fix(tmp_path):
    """A torch module, or an optimizer passed as the model, raises `CheckpointError` on every
    rank naming the type (was a raw AttributeError)."""
    def body(which):
        pl = sf.placement("cpu", [0, 1])
        m = sf.nn.Linear(3, 2)
        sf.parallel.apply(m, pl, {"*": sf.B})
        opt = sf.optim.SGD(m.parameters(), lr=0.1)
        sf.save(str(tmp_path / "ok"), m, opt)
        t = torch.nn.Linear(3, 2)
        calls = {"save torch": lambda: sf.save(str(tmp_path / "t"), t),
                 "load torch": lambda: sf.load(str(tmp_path / "ok"), t),
                 "load optimizer as model": lambda: sf.load(str(tmp_path / "ok"), opt),
                 "save torch optimizer": lambda: sf.save(
                     str(tmp_path / "o"), m, torch.optim.SGD(t.parameters(), lr=0.1))}
        try:
            calls[which]()
        except sf.CheckpointError as exc:
            return str(exc)
    for which, text in [("save torch", "sf.save: model must be an sf.nn.Module"),
                        ("load torch", "sf.nn.from_torch"),
                        ("load optimizer as model", "got sbpflow.optim.sgd.SGD"),
                        ("save torch optimizer", "optimizer must be an sf.optim optimizer")]:
        for got in sf.launch(body, world_size=2, args=(which,)):
            assert got is not None and text in got, (which, got)
