"""Checkpoint faults probe (issue 12 parts 2 and 3): are saves atomic, is damage detected?

(a) Kills. A child process saves a model and its SGD state (about ``--mb`` MB over ``--ranks``
    threads ranks, every rank writing its half) into ONE folder in a loop, each save with new
    values; it is SIGKILLed after a random delay (uniform over two save durations, measured
    once its first save is done). Then the folder must load, and hold exactly the values of the
    last save the child reported finished, or of the one it had started. Files in the folder
    that neither the committed checkpoint nor the one it replaced (kept until the next save, for
    loads that read the old manifest) uses are counted as leftovers; the next child's saves
    (and a final save here) must remove them.
(b) Corruptions. A small checkpoint is damaged in one way at a time: every file of it gets a
    byte flipped at its start, middle and end, is cut to half, loses its last byte, gets
    garbage appended, is deleted, or is replaced by the same file of another save; the manifest
    also gets bad JSON, is emptied, or gets a field of the wrong type. Each load must raise
    ``CheckpointError`` on every rank.

It prints both tables with the goals (100 %). Uses only sf.save / sf.load, so it also measures an
older sbpflow (``PYTHONPATH=<old checkout> python benchmarks/checkpoint_faults.py``).

    python benchmarks/checkpoint_faults.py [--kills 10] [--ranks 2] [--mb 10] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

import sbpflow as sf
from sbpflow.nn.checkpoint_files import LOCK_FILES

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "nn"))
from checkpoint_damage import FILE_DAMAGE, overwrite  # noqa: E402  (the tests' catalogue)


# -- the model and the values of each step --------------------------------------------------------
def _model(width: int, ranks: int):
    """In a rank: Linear(width, width) split over the ranks, and SGD with momentum state."""
    m = sf.nn.Sequential(sf.nn.Linear(width, width))
    sf.parallel.apply(m, sf.placement("cpu", list(range(ranks))), {"*": sf.S(0)})
    opt = sf.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    return m, opt


def _full(shape, step: int, i: int, sign: float) -> torch.Tensor:
    """Logical values of tensor ``i`` at ``step``: distinct per element, exact in float32."""
    n = math.prod(shape)
    return sign * ((torch.arange(n) % 4096).float() + 8192 * step + 4096 * i).reshape(shape)


def _set_step(m, opt, step: int) -> None:
    from sbpflow.optim.optimizer import state_like
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.local.copy_(sf.tensor(_full(p.shape, step, i, 1.0), p.placement, p.sbp).local)
            buf = state_like(p)
            buf.local.copy_(sf.tensor(_full(p.shape, step, i, -1.0), p.placement, p.sbp).local)
            opt.state[p]["momentum_buffer"] = buf


def _matches(m, opt, step: int) -> bool:
    for i, p in enumerate(m.parameters()):
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if buf is None or not torch.equal(p.full_tensor(), _full(p.shape, step, i, 1.0)) or \
                not torch.equal(buf.full_tensor(), _full(p.shape, step, i, -1.0)):
            return False
    return True


def _width(mb: float) -> int:
    return max(8, int(math.sqrt(mb * 1e6 / 8)))  # weight + momentum, float32


# -- (a) kills ------------------------------------------------------------------------------------
def _child(path: str, ranks: int, mb: float) -> None:
    """Save forever, step 1, 2, ...; rank 0 reports each save's start and end on stdout."""
    def body():
        m, opt = _model(_width(mb), ranks)
        step = 0
        while True:
            step += 1
            _set_step(m, opt, step)
            if sf.rank() == 0:
                print(f"start {step}", flush=True)
            t = time.perf_counter()
            sf.save(path, m, opt, step=step)
            if sf.rank() == 0:
                print(f"saved {step} {time.perf_counter() - t:.4f}", flush=True)
    sf.launch(body, world_size=ranks)


def _check_load(path: str, ranks: int, width: int):
    """Load the folder; ('ok', step) when it holds exactly the values of its step, else the
    problem: ('error', message) or ('wrong values', step)."""
    def body():
        m, opt = _model(width, ranks)
        try:
            step = sf.load(path, m, opt)
        except Exception as exc:  # noqa: BLE001 - the probe reports it
            return "error", f"{type(exc).__name__}: {str(exc)[:200]}"
        return ("ok" if _matches(m, opt, step) else "wrong values"), step
    results = sf.launch(body, world_size=ranks)
    return results[0] if all(r == results[0] for r in results) else ("ranks disagree", results)


def _committed(path: str) -> set:
    """Paths (relative) of the files the folder's committed checkpoint uses, and of the
    generation it replaced (kept by design until the next save, named ``previous``)."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return set()
    if isinstance(m, dict) and "generation" in m:
        previous = m.get("previous") or None  # "" : a format-1 checkpoint, not made here
        gens = [m["generation"]] + ([previous] if previous else [])
        return {"manifest.json"} | {os.path.join(g, n) for g in gens for n in m["files"]}
    names = {"manifest.json", "common.pt"}
    return names | {f"rank{r}.{e}" for r in range(m.get("world_size", 0)) for e in ("pt", "json")}


def _leftovers(path: str) -> tuple[int, int]:
    """(files, bytes) in the folder that its committed checkpoint does not use."""
    keep, n, size = _committed(path), 0, 0
    for root, _, files in os.walk(path):
        for name in files:
            rel = os.path.relpath(os.path.join(root, name), path)
            if rel not in keep and rel not in LOCK_FILES:
                n += 1
                size += os.path.getsize(os.path.join(root, name))
    return n, size


def _one_kill(path: str, args, rng: random.Random) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", path, "--ranks",
           str(args.ranks), "--mb", str(args.mb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    first = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.split())
            if line.startswith("saved"):
                first.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while not first.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the saving child made no save: {proc.stderr.read()[-2000:]}")
    duration = float(next(w for w in lines if w[0] == "saved")[2])
    time.sleep(rng.uniform(0, 2 * duration))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(5)
    done = max(int(w[1]) for w in lines if w[0] == "saved")
    mid_save = lines[-1][0] == "start"
    status, step = _check_load(path, args.ranks, _width(args.mb))
    ok = status == "ok" and step in (done, done + 1)
    files, size = _leftovers(path)
    return {"ok": ok, "mid_save": mid_save, "status": status, "step": step, "done": done,
            "leftover_files": files, "leftover_bytes": size, "save_s": duration}


def probe_kills(args, workdir: str) -> dict:
    rng = random.Random(args.seed)
    path = os.path.join(workdir, "kills")
    trials = []
    for i in range(args.kills):
        t = _one_kill(path, args, rng)
        trials.append(t)
        if not t["ok"]:
            print(f"  kill {i}: NOT loadable as step {t['done']} or {t['done'] + 1}: "
                  f"{t['status']} {t['step']}", flush=True)
    width, ranks = _width(args.mb), args.ranks

    def final_save():
        m, opt = _model(width, ranks)
        _set_step(m, opt, 1)
        sf.save(path, m, opt, step=1)
    sf.launch(final_save, world_size=ranks)
    return {"trials": trials, "after_next_save": _leftovers(path)}


# -- (b) corruptions ------------------------------------------------------------------------------
def _wrong_type(p: str, _other: str) -> None:
    with open(p) as f:
        m = json.load(f)
    m["world_size"] = str(m["world_size"])
    with open(p, "w") as f:
        json.dump(m, f)


def _one_file(damage):
    """A damage of the file alone, called as the probe calls every damage: (path, the same
    file of another save)."""
    return lambda p, _other: damage(p)


# the file damages of the tests (tests/nn/checkpoint_damage.py), plus one needing a second save
DAMAGE = {**{kind: _one_file(f) for kind, f in FILE_DAMAGE.items()},
          "file-of-another-save": lambda p, other: shutil.copyfile(other, p)}
MANIFEST_DAMAGE = {"bad-json": _one_file(overwrite(b'{"format": 2, "save_id": ')),
                   "empty": _one_file(overwrite(b"")), "field-of-wrong-type": _wrong_type}


def _files(path: str) -> dict:
    """{file name: path} of every file of a checkpoint folder (not its writer lock's)."""
    return {name: os.path.join(root, name) for root, _, files in os.walk(path) for name in files
            if name not in LOCK_FILES}


def _small_checkpoint(path: str, ranks: int, step: int) -> None:
    def body():
        m, opt = _model(16, ranks)
        _set_step(m, opt, step)
        sf.save(path, m, opt, step=step)
    sf.launch(body, world_size=ranks)


def probe_corruptions(args, workdir: str) -> list:
    good, other = os.path.join(workdir, "good"), os.path.join(workdir, "other")
    _small_checkpoint(good, args.ranks, 1)
    _small_checkpoint(other, args.ranks, 2)
    other_files = _files(other)
    cases = [(name, kind, fn) for name in sorted(_files(good)) for kind, fn in DAMAGE.items()]
    cases += [("manifest.json", kind, fn) for kind, fn in MANIFEST_DAMAGE.items()]
    rows = []
    for name, kind, damage in cases:
        path = os.path.join(workdir, "damaged")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(good, path)
        damage(_files(path)[name], other_files[name])
        rows.append((name, kind, _raised(path, args.ranks)))
    return rows


def _raised(path: str, ranks: int) -> str:
    """'detected' if every rank raised CheckpointError, else what happened."""
    def body():
        m, opt = _model(16, ranks)
        try:
            sf.load(path, m, opt)
        except sf.nn.CheckpointError:
            return "detected"
        except Exception as exc:  # noqa: BLE001 - the probe reports it
            return type(exc).__name__
        return "loaded silently"
    got = sf.launch(body, world_size=ranks, timeout=30)
    return "detected" if all(g == "detected" for g in got) else "/".join(sorted(set(got)))


# -- report ---------------------------------------------------------------------------------------
def _pct(a: int, b: int) -> str:
    return f"{a}/{b} ({100 * a / max(b, 1):.0f} %)"


def report(kills: dict, rows: list, args) -> None:
    t = kills["trials"]
    ok = sum(x["ok"] for x in t)
    print(f"\n(a) SIGKILL during saves into one folder ({args.ranks} ranks, model + SGD state "
          f"{8 * _width(args.mb) ** 2 / 1e6:.1f} MB, one save "
          f"{1000 * sum(x['save_s'] for x in t) / max(len(t), 1):.0f} ms)")
    print(f"  kills tried                      {len(t)}  (landed inside a save: "
          f"{sum(x['mid_save'] for x in t)})")
    print(f"  loadable, old or new values      {_pct(ok, len(t))}   goal 100 %")
    print(f"  of which the old / the new one   {sum(x['ok'] and x['step'] == x['done'] for x in t)}"
          f" / {sum(x['ok'] and x['step'] == x['done'] + 1 for x in t)}")
    worst = max(t, key=lambda x: x["leftover_files"], default=None)
    if worst is not None:
        print(f"  leftovers after a kill (most)    {worst['leftover_files']} files, "
              f"{worst['leftover_bytes'] / 1e6:.1f} MB")
    files, size = kills["after_next_save"]
    print(f"  leftovers after the next save    {files} files, {size / 1e6:.1f} MB")
    print("\n(b) damaged checkpoints: every rank must raise CheckpointError")
    kinds = list(dict.fromkeys(k for _, k, _ in rows))
    print(f"  {'damage':<22} {'tried':>5} {'detected':>9}  other outcomes")
    for kind in kinds:
        mine = [(n, r) for n, k, r in rows if k == kind]
        bad = [f"{n}: {r}" for n, r in mine if r != "detected"]
        print(f"  {kind:<22} {len(mine):>5} {sum(r == 'detected' for _, r in mine):>9}  "
              f"{'; '.join(bad)}")
    det = sum(r == "detected" for _, _, r in rows)
    print(f"  corruptions detected             {_pct(det, len(rows))}   goal 100 %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mb", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.ranks, args.mb)
        return
    workdir = args.dir or tempfile.mkdtemp(prefix="sbpflow-ckpt-faults-")
    try:
        start = time.perf_counter()
        kills = probe_kills(args, workdir)
        rows = probe_corruptions(args, workdir)
        report(kills, rows, args)
        print(f"\n({time.perf_counter() - start:.0f} s)")
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
