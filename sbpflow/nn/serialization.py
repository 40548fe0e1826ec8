"""Distributed checkpoints: ``sf.save(path_dir, model, optimizer, step=)`` and
``sf.load(path_dir, model, optimizer)``.

A checkpoint directory holds ``manifest.json`` (the commit point) and generation directories
of per-rank shards and indexes; a save is atomic as a whole, replicas are written once, and
``load`` verifies every file (``CheckpointError`` on every rank) and fills the model's CURRENT
layouts, which may differ from the saved ones in sbp, placement and world size. Saves to one
folder run one at a time (its writer lock); a failed save removes what it wrote.
See docs/internals.md, 'Checkpoints' (the files, the commit, what is written and read).
"""

from __future__ import annotations

import json
import operator
import os
import secrets
from typing import NamedTuple

import torch

from .. import comm as _comm
from ..boxing import identity_value
from ..boxing.boxes import box_numel, box_shape, intersect, relative
from ..errors import SbpError
from ..param_state import mark_stale, update_layout
from ..sbp import Broadcast, Partial, format_nd_sbp, holds_value, shard_box
from ..tensor import GlobalTensor, zeros as _sf_zeros
from . import checkpoint_files as _files
from .checkpoint_files import FORMAT, MANIFEST, CheckpointError, CheckpointShapeError
from .modules import Module

__all__ = ["save", "load", "CheckpointError", "CheckpointShapeError", "FORMAT"]

LOCK_TIMEOUT = 120.0  # seconds a save waits for another writer's (SBPFLOW_CHECKPOINT_LOCK_TIMEOUT)


# -- helpers --------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _describe(t: GlobalTensor) -> dict:
    return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
            "placement": {"device_type": t.placement.device_type, "ranks": t.placement.ranks},
            "sbp": [repr(s) for s in t.sbp]}


def _param_names(model: Module) -> dict:
    return {id(p): n for n, p in model.named_parameters()}


def _check_objects(what: str, model, optimizer) -> None:
    """`CheckpointError` unless ``model`` is an ``sf.nn.Module`` and ``optimizer`` (if given)
    an ``sf.optim`` optimizer: a checkpoint holds global tensors."""
    if not isinstance(model, Module):
        raise CheckpointError(f"{what}: model must be an sf.nn.Module (a torch module: convert "
                              f"it with sf.nn.from_torch, or save it with torch.save), got "
                              f"{type(model).__module__}.{type(model).__name__}")
    if optimizer is not None and not (hasattr(optimizer, "param_groups") and all(
            isinstance(p, GlobalTensor) for g in optimizer.param_groups for p in g["params"])):
        raise CheckpointError(f"{what}: optimizer must be an sf.optim optimizer over the "
                              f"model's parameters, got {type(optimizer).__module__}."
                              f"{type(optimizer).__name__}")


def _tensors(model: Module, optimizer) -> list[tuple[str, GlobalTensor]]:
    """(key, tensor) for everything saved, in the same order on every rank."""
    _check_objects("sf.save", model, optimizer)
    items = [(f"model/{k}", t) for k, t in model._state_items()]
    if optimizer is not None:
        names = _param_names(model)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise CheckpointError(
                        f"the optimizer holds a parameter of shape {tuple(p.shape)} (placement "
                        f"{p.placement}, sbp {format_nd_sbp(p.sbp)}) that is not in the model; "
                        f"build the optimizer from model.parameters() after sf.parallel.apply")
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, GlobalTensor):
                        items.append((f"optim/{names[id(p)]}/{k}", v))
    return items


def _writes(t: GlobalTensor) -> bool:
    """Whether this rank writes ``t``'s shard: in the placement, first along every B dim."""
    me = _comm.rank()
    if me not in t.placement:
        return False
    coord = t.placement.coord_of(me)
    return all(c == 0 for s, c in zip(t.sbp, coord) if isinstance(s, Broadcast))


def _partial_op(t: GlobalTensor):
    ops = {s.op for s in t.sbp if isinstance(s, Partial)}
    if len(ops) > 1:
        raise CheckpointError(f"cannot save a tensor partial under several reductions "
                              f"({format_nd_sbp(t.sbp)})")
    return next(iter(ops), None)


def _agree(error: BaseException | None, what: str, values: tuple = ()) -> list[list[int]]:
    """Collective: each rank reports its error (or None) and the same number of ints; returns
    every rank's ints, in rank order. If any rank failed, raises on EVERY rank (so none waits
    for the others): a failing rank its own exception, the others a `CheckpointError` naming
    each failing rank and its error. One all-gather when all succeed."""
    comm = _comm.current()
    group = tuple(range(comm.world_size))
    msg = b"" if error is None else f"{type(error).__name__}: {error}".encode()
    mine = torch.tensor([len(msg), *values], dtype=torch.int64)
    rows = comm.all_gather(mine, group, shapes=[tuple(mine.shape)] * len(group))
    lengths = [int(r[0]) for r in rows]
    n = max(lengths)
    if n == 0:
        return [[int(v) for v in r[1:]] for r in rows]
    buf = torch.zeros(n, dtype=torch.uint8)
    buf[:len(msg)] = torch.tensor(list(msg), dtype=torch.uint8)
    texts = comm.all_gather(buf, group, shapes=[(n,)] * len(group))
    if error is not None:
        raise error
    failed = "; ".join(f"rank {r}: {bytes(t[:k].tolist()).decode('utf-8', 'replace')}"
                       for r, (t, k) in enumerate(zip(texts, lengths)) if k)
    raise CheckpointError(f"{what} failed on another rank ({failed})")


# -- save -----------------------------------------------------------------------------------------
def save(path_dir: str, model: Module, optimizer=None, step: int | None = None,
         extra: dict | None = None, *, lock_timeout: float | None = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to directory ``path_dir``,
    atomically: a save that fails or is killed at any moment leaves the previous checkpoint
    there loadable and unchanged. Every rank must call it, with the same tensors (keys,
    shapes, dtypes, layouts); each writes its own shards. ``extra``: small JSON data (dict
    keys strings) kept in the manifest (returned by `load` through ``info=``). A failure on
    any rank raises on every rank, and removes what this save wrote; running out of disk
    space raises `CheckpointError` saying so, with the bytes the save needs and those free.
    The checkpoint this one replaces stays in the folder until the next save (for loads that
    began before the commit).

    Saves to one folder run one at a time (rank 0 holds the folder's writer lock,
    ``writer.lock``, for the whole save): a save that finds another writer's save in progress
    (another job) waits for it, up to ``lock_timeout`` seconds (default
    ``SBPFLOW_CHECKPOINT_LOCK_TIMEOUT``, else 120, shortened to half the world's collective
    timeout, for which the other ranks wait), then raises `CheckpointError` on every rank
    naming the other writer's host and pid. A larger ``lock_timeout`` than that half is
    refused."""
    lock = _files.WriterLock(path_dir)
    try:
        _save(path_dir, model, optimizer, step, extra, lock_timeout, lock)
    finally:
        lock.release()


def _save(path_dir: str, model: Module, optimizer, step, extra, lock_timeout,
          lock: _files.WriterLock) -> None:
    """`save`, with rank 0 taking ``lock`` (the caller releases it)."""
    me = _comm.rank()
    unchanged = f"sf.save to {path_dir!r} (the checkpoint there is unchanged)"
    items, error, need, free = [], None, 0, 0
    try:
        step = _check_arguments(step, extra)
        timeout = _lock_timeout(lock_timeout)
        items = _tensors(model, optimizer)
        need = _bytes_to_write(items)
        if me == 0:
            free = _lock_and_prune(path_dir, lock, timeout)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
        error = exc
    # one exchange: argument and lock errors, rank 0's fresh save id, each rank's list of
    # tensors, each rank's bytes to write, the bytes free (rank 0's measure)
    rows = _agree(error, unchanged, (secrets.randbits(62) if me == 0 else 0,
                                     _files.canonical_crc([[k, _describe(t)] for k, t in items]),
                                     need, free))
    _check_same_tensors([row[1] for row in rows], path_dir)
    save_id = rows[0][0]
    gen = _files.generation_name(save_id)
    space = (sum(row[2] for row in rows), rows[0][3])
    try:
        records, rows = _write_phase(path_dir, gen, save_id, model, optimizer, items,
                                     unchanged, space)
        body = (save_id, gen, step, extra, items, records.get("common.pt"), rows)
        previous = _commit_phase(path_dir, gen, body, space)
    except Exception:
        if me == 0:  # every rank is done with the generation (the agreements)
            _files.discard(path_dir, gen)
        raise
    if me == 0:  # after the agreement: no rank waits for the removal of old files
        _files.clean(path_dir, {gen} if previous is None else {gen, previous},
                     legacy=previous != "")


def _lock_timeout(value) -> float:
    """The seconds rank 0 waits for another writer's save: ``value``, else
    ``SBPFLOW_CHECKPOINT_LOCK_TIMEOUT``, else `LOCK_TIMEOUT` shortened to the most allowed:
    half the collective timeout where other ranks wait for the lock (the save's first
    collective). A given value outside ``[0, that]`` raises `CheckpointError`."""
    comm = _comm.current()
    most = comm.wait_timeout() / 2 if comm.world_size > 1 else float("inf")
    source = "lock_timeout"
    if value is None:
        value = os.environ.get("SBPFLOW_CHECKPOINT_LOCK_TIMEOUT")
        if value is None:
            return min(LOCK_TIMEOUT, most)
        source = "SBPFLOW_CHECKPOINT_LOCK_TIMEOUT"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"sf.save: {source} must be a number of seconds, got "
                              f"{value!r}") from None
    if not 0 <= seconds <= most:
        raise CheckpointError(
            f"sf.save: {source}={seconds:g} s must lie in [0, {most:g}]: the other ranks wait "
            f"for the folder's writer lock inside a collective, which gives up after "
            f"{2 * most:g} s (SBPFLOW_TIMEOUT, or sf.launch(..., timeout=)); raise that "
            f"timeout or wait less. Nothing was written")
    return seconds


def _lock_and_prune(path_dir: str, lock: _files.WriterLock, timeout: float) -> int:
    """Rank 0, before any file is written: take the folder's writer lock, remove what killed
    or failed saves left (only under the lock: never another writer's save in progress);
    returns the bytes then free (-1: unknown)."""
    what = f"sf.save to {path_dir!r}"
    if lock.acquire(timeout, what):
        _files.prune(path_dir)
    return _files.free_bytes(path_dir)


def _bytes_to_write(items: list) -> int:
    """About how many bytes this rank's files of a save take: its shards, plus (measured)
    about 2 kB of zip and index a rank, 300 bytes a tensor, 1.5 kB of ``common.pt`` (rank 0)."""
    mine = [t for _, t in items if _writes(t)]
    data = sum(t.local.numel() * t.local.element_size() for t in mine)
    return data + 2048 + 300 * len(mine) + (1536 if _comm.rank() == 0 else 0)


def _space_error(path_dir: str, who: str, full: OSError, space: tuple) -> CheckpointError:
    """The `CheckpointError` of a save that ran out of disk space (``full``: the file
    system's error, naming the file), with ``space``: (bytes the save needs, bytes free when it
    began, -1 if unknown)."""
    need, free = space
    had = f"{free} bytes were free there when it began" if free >= 0 else \
        "the free space there could not be read"
    return CheckpointError(
        f"sf.save to {path_dir!r}: {who} ran out of disk space ({full}): the save needs about "
        f"{need} bytes in {path_dir!r}, {had} (os.statvfs). The checkpoint there is unchanged "
        f"and this save's files are removed; free space (the folder needs room for the new "
        f"checkpoint besides the committed one and the one it replaced) or save to another "
        f"folder")


def _check_arguments(step, extra) -> int | None:
    """``step`` as an int (or None); `CheckpointError` unless ``extra`` can be written in the
    manifest as the commit will write it (checked before any file is written)."""
    try:
        step = None if step is None else operator.index(step)
    except TypeError:
        raise CheckpointError(f"sf.save: step must be an int or None, got {step!r}") from None
    try:
        _files.encode_manifest({"extra": extra})
    except (TypeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"sf.save: extra cannot be written in {MANIFEST} ({exc}); pass "
                              f"JSON data whose dict keys are all strings") from None
    return step


def _check_same_tensors(crcs: list[int], path_dir: str) -> None:
    """Every rank must save the same tensors (the manifest describes rank 0's): raise
    `CheckpointError` on every rank alike, before any file is written, if some differ."""
    differ = [r for r, c in enumerate(crcs) if c != crcs[0]]
    if differ:
        raise CheckpointError(
            f"sf.save to {path_dir!r}: rank(s) {differ} save other tensors than rank 0 (keys, "
            f"shapes, dtypes, placements or sbps differ); every rank must pass the same model "
            f"and optimizer layout. Nothing was written; the checkpoint there is unchanged")


def _write_phase(path_dir: str, gen: str, save_id: int, model: Module, optimizer,
                 items: list, unchanged: str, space: tuple) -> tuple[dict, list[list[int]]]:
    """Collective: every rank writes its files of ``gen``; returns this rank's records and
    every rank's ``[pt size, pt crc32, json size, json crc32]``. A failure on any rank raises
    on every rank (out of disk space: `_space_error`, with ``space``)."""
    me = _comm.rank()
    records, error = {}, None
    try:
        records = _write_generation(path_dir, gen, save_id, model, optimizer, items)
    except SbpError as exc:
        error = exc
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
        full = _files.out_of_space(exc)
        error = _space_error(path_dir, f"rank {me}", full, space) if full is not None else \
            CheckpointError(f"sf.save: rank {me} could not write its files in {path_dir!r}: "
                            f"{exc!r}")
        error.__cause__ = exc
    mine = tuple(records.get(f"rank{me}.{e}", {}).get(k, 0) for e in ("pt", "json")
                 for k in ("size", "crc32"))
    return records, _agree(error, unchanged, mine)


def _commit_phase(path_dir: str, gen: str, body: tuple, space: tuple) -> str | None:
    """Collective: rank 0 commits generation ``gen`` (``body``: `_manifest_body`'s arguments)
    once every rank's files are durable; returns the generation the manifest named before
    (`_commit`; None on the other ranks). A failure raises on every rank."""
    error = previous = None
    if _comm.rank() == 0:
        try:
            previous = _commit(path_dir, gen, _manifest_body(*body))
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            full = _files.out_of_space(exc)
            error = _space_error(path_dir, "rank 0's commit", full, space) if full is not None \
                else CheckpointError(f"sf.save: rank 0 could not commit the checkpoint in "
                                     f"{path_dir!r} (the checkpoint there is unchanged): {exc!r}")
            error.__cause__ = exc
    _agree(error, f"sf.save to {path_dir!r}: the commit")
    return previous


def _manifest_body(save_id: int, gen: str, step, extra, items: list, common: dict,
                   rows: list) -> dict:
    """The manifest of save ``save_id`` (rank 0), from the record of ``common.pt`` and every
    rank's file records ``rows``."""
    comm = _comm.current()
    files = {"common.pt": common}
    for r, (pt_size, pt_crc, js_size, js_crc) in enumerate(rows):
        files[f"rank{r}.pt"] = {"size": pt_size, "crc32": pt_crc}
        files[f"rank{r}.json"] = {"size": js_size, "crc32": js_crc}
    return {"format": FORMAT, "save_id": save_id, "generation": gen,
            "world_size": comm.world_size, "step": step, "extra": extra,
            "tensors": {k: _describe(t) for k, t in items}, "files": files}


def _write_generation(path_dir: str, gen: str, save_id: int, model: Module, optimizer,
                      items: list) -> dict:
    """This rank's files of generation ``gen``, written and fsynced; returns their records
    (``{name: {"size", "crc32"}}``); rank 0 also writes ``common.pt``."""
    gdir = os.path.join(path_dir, gen)
    os.makedirs(gdir, exist_ok=True)
    records = _write_shards(gdir, save_id, items)
    if _comm.rank() == 0:
        common = _common(save_id, model, optimizer)
        records["common.pt"] = _files.write_file(os.path.join(gdir, "common.pt"),
                                                 lambda f: torch.save(common, f))
    _files.fsync_dir(gdir)
    return records


def _write_shards(gdir: str, save_id: int, items: list) -> dict:
    """Write ``rank{r}.pt`` (this rank's shards) and ``rank{r}.json`` (their index)."""
    me = _comm.rank()
    shards, index = {}, {}
    for key, t in items:
        if not _writes(t):
            continue
        coord = t.placement.coord_of(me)
        local = t.local.detach()
        # a clone: a view would make torch.save write the whole underlying storage
        shards[key] = local.to("cpu").clone(memory_format=torch.contiguous_format)
        index[key] = {**_describe(t),
                      "box": [list(b) for b in shard_box(tuple(t.shape), t.placement.shape,
                                                         t.sbp, coord)],
                      "partial": _partial_op(t)}
    data = {"save_id": save_id, "rank": me, "tensors": shards}
    text = json.dumps({"save_id": save_id, "rank": me, "entries": index}).encode()
    return {f"rank{me}.pt": _files.write_file(os.path.join(gdir, f"rank{me}.pt"),
                                              lambda f: torch.save(data, f)),
            f"rank{me}.json": _files.write_file(os.path.join(gdir, f"rank{me}.json"),
                                                lambda f: f.write(text))}


def _common(save_id: int, model: Module, optimizer) -> dict:
    comm = _comm.current()
    common = {"save_id": save_id, "optim": None,
              "rng": [comm.per_rank.seed, comm.per_rank.seed_counter]}
    if optimizer is not None:
        names = _param_names(model)
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
        scalars = {names[id(p)]: {k: v for k, v in optimizer.state.get(p, {}).items()
                                  if not isinstance(v, GlobalTensor)}
                   for g in optimizer.param_groups for p in g["params"]}
        common["optim"] = {"class": type(optimizer).__name__, "param_groups": groups,
                           "scalars": scalars}
    return common


def _commit(path_dir: str, gen: str, body: dict) -> str | None:
    """Rank 0, once every rank's files are durable: publish the manifest of ``gen`` (the
    atomic switch to the new checkpoint). Returns the generation the manifest named before
    ("" for format 1, None if none was readable): it stays until the next save, for loads
    that read the old manifest; the caller removes everything else."""
    previous = _files.referenced_generation(path_dir)
    _files.fsync_dir(path_dir)  # the new generation's directory entry, before it is named
    _files.write_manifest(path_dir, {**body, "previous": previous}, tag=gen)
    return previous


# -- load -----------------------------------------------------------------------------------------
def _shared_manifest(path_dir: str) -> bytes:
    """Collective: the bytes of ``path_dir``'s manifest, read once, by rank 0, and broadcast,
    so that every rank loads the same checkpoint even if a save commits meanwhile (the
    generation it names stays until the save after that one). If rank 0 cannot read it,
    every rank raises the same `CheckpointError`."""
    comm = _comm.current()
    group = tuple(range(comm.world_size))
    data, failed = b"", 0
    if comm.rank == 0:
        try:
            data = _files.read_manifest_bytes(path_dir)
        except Exception as exc:  # noqa: BLE001 - every rank raises it below
            failed = 1
            data = (str(exc) if isinstance(exc, CheckpointError) else
                    f"sf.load: rank 0 could not read {MANIFEST} in {path_dir!r}: {exc!r}").encode()
    head = comm.broadcast(torch.tensor([failed, len(data)], dtype=torch.int64), 0, group)
    n = int(head[1])
    if n:
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if comm.rank == 0 \
            else torch.zeros(n, dtype=torch.uint8)
        data = comm.broadcast(buf, 0, group).numpy().tobytes()
    if int(head[0]):
        raise CheckpointError(data.decode("utf-8", "replace"))
    return data


class _Region(NamedTuple):
    """How to read one box of a saved tensor: the pieces that overlap it (rank, piece box,
    overlap) and their reduction (None: the value itself, pieces disjoint)."""
    box: tuple
    op: str | None
    sources: list


class _Target(NamedTuple):
    """A tensor to fill: saved ``key``, the ``tensor`` whose layout is filled (for the
    optimizer: its parameter), the optimizer's state key (None for the model), and the
    region this rank reads (None: it holds none, see `_box_to_read`)."""
    key: str
    tensor: GlobalTensor
    skey: str | None
    region: _Region | None


class _Reader:
    """A checkpoint's manifest (given: rank 0 read it for every rank), its rank indexes (read
    and verified by every rank), the saved pieces of every key, and the data files, opened
    memory-mapped; each data file's checksum is verified by one rank (`open`)."""

    def __init__(self, path_dir: str, manifest: bytes) -> None:
        self.dir = path_dir
        self.manifest = m = _files.parse_manifest(path_dir, manifest)
        self.save_id = m["save_id"]
        self.files = m.get("files")  # None: format 1, no checksums
        self.data_dir = path_dir if self.files is None else os.path.join(path_dir,
                                                                          m["generation"])
        self.entries: dict[int, dict] = {}
        self.pieces: dict[str, list] = {}
        for r in range(m["world_size"]):
            name = f"rank{r}.json"
            data = _files.read_verified(self._path(name), self._record(name))
            meta = _files.parse_json(self._path(name), data)
            _files.validate_rank_index(self._path(name), meta, r, self.save_id, m["tensors"])
            self.entries[r] = meta["entries"]
            for key, e in meta["entries"].items():
                self.pieces.setdefault(key, []).append(
                    (r, tuple(tuple(b) for b in e["box"]), e.get("partial")))
        self._files: dict[int, dict] = {}
        self._common = None

    def _path(self, name: str) -> str:
        return os.path.join(self.data_dir, name)

    def _record(self, name: str) -> dict | None:
        return None if self.files is None else self.files[name]

    def _torch_load(self, name: str, **kw):
        path = self._path(name)
        if self.files is not None:  # a stat: a truncated file is never memory-mapped
            _files.check_size(path, self.files[name])
        try:
            return torch.load(path, weights_only=True, map_location="cpu", **kw)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: damaged or incomplete checkpoint") \
                from None
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a damaged checkpoint
            raise CheckpointError(f"{path}: not a readable torch file ({exc}): damaged "
                                  f"checkpoint") from exc

    @property
    def common(self) -> dict:
        if self._common is None:
            common = self._torch_load("common.pt")
            _files.validate_common(self._path("common.pt"), common, self.save_id)
            self._common = common
        return self._common

    def _file(self, r: int) -> dict:
        if r not in self._files:
            data = self._torch_load(f"rank{r}.pt", mmap=True)
            _files.validate_shards(self._path(f"rank{r}.pt"), data, r, self.save_id,
                                   self.entries[r])
            self._files[r] = data["tensors"]
        return self._files[r]

    def open(self, ranks: set, common: bool) -> None:
        """Verify this rank's share of the data files, then open the files of ``ranks`` (and
        ``common.pt``). Each data file is verified by exactly one rank (``rank{r}.pt`` by rank
        ``r``, ``common.pt`` by the next, modulo the world size); a rank uses files others
        verified because the load's agreement, after this and before any data is used, tells
        every rank whether all were sound. Indexes were verified as they were read."""
        if self.files is not None:
            comm = _comm.current()
            saved = self.manifest["world_size"]
            names = [f"rank{r}.pt" for r in range(saved)] + ["common.pt"]
            for i, name in enumerate(names):
                if i % comm.world_size == comm.rank:
                    _files.verify_file(self._path(name), self.files[name])
        for r in sorted(ranks):
            self._file(r)
        if common:
            self.common  # noqa: B018 - read and validated now, before anything is changed

    def described(self, key: str) -> dict | None:
        return self.manifest["tensors"].get(key)

    def region(self, key: str, box: tuple) -> _Region:
        """Plan the read of ``box`` of saved tensor ``key`` (nothing is read): the pieces that
        overlap it. `CheckpointError` if the pieces disagree on their reduction, or if a value
        saved whole (not partial) is not covered exactly by them."""
        pieces = self.pieces.get(key, [])
        ops = {op for _, _, op in pieces}
        if len(ops) > 1:
            raise CheckpointError(f"{key}: saved pieces disagree on their reduction: "
                                  f"{sorted(ops, key=str)} (corrupt checkpoint)")
        op = next(iter(ops), None)
        sources = [(r, pbox, inter) for r, pbox, _ in pieces
                   if box_numel(inter := intersect(box, pbox))]
        covered = sum(box_numel(inter) for _, _, inter in sources)
        if op is None and covered != box_numel(box):
            raise CheckpointError(f"{key}: the checkpoint's pieces cover {covered} of the "
                                  f"{box_numel(box)} elements of region {box} (corrupt or "
                                  f"incomplete checkpoint)")
        return _Region(box, op, sources)

    def read(self, key: str, region: _Region, dtype: torch.dtype) -> torch.Tensor:
        """The logical values of ``region`` (planned by `region`) of saved tensor ``key``."""
        op, box = region.op, region.box
        if op in ("max", "min"):
            out = torch.full(box_shape(box), identity_value(op, dtype), dtype=dtype)
        else:
            out = torch.zeros(box_shape(box), dtype=dtype)
        for r, pbox, inter in region.sources:
            src = self._file(r)[key][relative(inter, pbox)].to(dtype)
            dst = out[relative(inter, box)]
            if op is None:
                dst.copy_(src)
            elif op == "sum":
                dst.add_(src)
            elif op == "max":
                torch.maximum(dst, src, out=dst)
            else:
                torch.minimum(dst, src, out=dst)
        return out


def _box_to_read(t: GlobalTensor) -> tuple | None:
    """The region of ``t`` this rank reads from a checkpoint: its shard's box; None outside
    the placement, or where it does not hold the value of a partial layout
    (`sbp.holds_value`: it holds zeros)."""
    me = _comm.rank()
    if me not in t.placement:
        return None
    coord = t.placement.coord_of(me)
    if not holds_value(t.sbp, coord):
        return None
    return shard_box(tuple(t.shape), t.placement.shape, t.sbp, coord)


def _restore(reader: _Reader, target: _Target, t: GlobalTensor) -> None:
    """Fill ``t``'s shard (the layout of ``target.tensor``) from saved tensor ``target.key``,
    as planned."""
    if _comm.rank() not in t.placement:
        return
    mark_stale(t)   # a ZeRO-2 parameter's whole copy is gathered again before its next use
    local = t.local
    with torch.no_grad():
        if target.region is None:
            local.zero_()
        else:
            local.copy_(reader.read(target.key, target.region, local.dtype)
                        .reshape(local.shape))


def _check_shape(reader: _Reader, key: str, t: GlobalTensor, what: str) -> None:
    """`CheckpointShapeError` (a `CheckpointError` and a `ShapeError`) unless saved tensor
    ``key`` has ``t``'s logical shape."""
    d = reader.described(key)
    if tuple(d["shape"]) != tuple(t.shape):
        raise CheckpointShapeError(
            f"sf.load from {reader.dir!r}: {what} has shape {tuple(d['shape'])} in the "
            f"checkpoint (saved on {d['placement']['ranks']} with sbp {d['sbp']}) but "
            f"{tuple(t.shape)} in the model (placement {t.placement}, sbp "
            f"{format_nd_sbp(t.sbp)}); build the model with the shapes it was saved with")


def load(path_dir: str, model: Module, optimizer=None, *, strict: bool = True,
         restore_rng: bool = True, info: dict | None = None):
    """Load a checkpoint written by `save` into ``model`` (and ``optimizer``) in their current
    layouts; returns the saved ``step``. Every rank must call it. Everything is checked first
    (manifest, files' sizes and checksums, keys, shapes, optimizer class, that the saved
    pieces cover what each rank reads): any problem found by any rank raises on every rank —
    `CheckpointError` for a damaged or unfit checkpoint (`CheckpointShapeError`, also a
    ``ShapeError``, for a tensor saved with another shape than the model's) — and leaves the
    model and optimizer unchanged. ``strict``: model keys missing from the checkpoint (or
    extra ones) raise `CheckpointError`. ``info``: a dict filled with the manifest's
    ``extra`` and ``world_size``."""
    manifest = _shared_manifest(path_dir)
    reader = targets = error = None
    try:
        reader = _Reader(path_dir, manifest)
        targets = _plan(reader, model, optimizer, strict)
        needed = {r for x in targets if x.region is not None for r, _, _ in x.region.sources}
        reader.open(needed, common=optimizer is not None or restore_rng)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
        error = exc
    _agree(error, f"sf.load from {path_dir!r}")
    # nothing below can fail on a sound checkpoint: every check ran before the agreement
    if optimizer is not None:
        _load_optimizer(reader, model, optimizer, [x for x in targets if x.skey is not None])
    for x in targets:
        if x.skey is None:
            _restore(reader, x, x.tensor)
    if restore_rng:
        seed, counter = reader.common["rng"]
        state = _comm.current().per_rank
        state.seed, state.seed_counter = int(seed), int(counter)
    if info is not None:
        info.update(extra=reader.manifest.get("extra"), world_size=reader.manifest["world_size"])
    _comm.current().barrier()
    return reader.manifest.get("step")


def _plan(reader: _Reader, model: Module, optimizer, strict: bool) -> list[_Target]:
    """Check that the checkpoint fits ``model`` (and ``optimizer``); returns what to read and
    where this rank reads it from (`_Reader.region`, which checks the saved pieces)."""
    _check_objects("sf.load", model, optimizer)
    model_items = model._state_items()
    saved_model = {k[len("model/"):] for k in reader.manifest["tensors"] if k.startswith("model/")}
    missing = [k for k, _ in model_items if k not in saved_model]
    unexpected = sorted(saved_model - {k for k, _ in model_items})
    if strict and (missing or unexpected):
        raise CheckpointError(f"sf.load from {reader.dir!r}: the model's keys missing from the "
                              f"checkpoint: {missing}; keys in the checkpoint the model lacks: "
                              f"{unexpected}")
    targets = []
    for k, t in model_items:
        if k in saved_model:
            _check_shape(reader, f"model/{k}", t, f"tensor {k!r}")
            targets.append((f"model/{k}", t, None))
    if optimizer is not None:
        targets += _plan_optimizer(reader, model, optimizer)
    out = []
    for key, t, skey in targets:
        # optimizer state lives in the parameter's update layout (split for ZeRO stage 1)
        box = _box_to_read(t if skey is None else _in_update_layout(t))
        out.append(_Target(key, t, skey, None if box is None else reader.region(key, box)))
    return out


def _in_update_layout(p: GlobalTensor) -> GlobalTensor:
    """``p``'s metadata with its update layout (`sbpflow.param_state.update_layout`)."""
    lay = update_layout(p)
    return p if lay == p.sbp else GlobalTensor(p.local, tuple(p.shape), p.placement, lay)


def _plan_optimizer(reader: _Reader, model: Module, optimizer) -> list[tuple]:
    """Check the saved optimizer state fits ``optimizer`` (class, groups, parameters,
    shapes); returns ``(key, parameter, state key)`` for each saved state tensor."""
    optim = reader.common["optim"]
    if optim is None:
        raise CheckpointError(f"sf.load: the checkpoint in {reader.dir!r} has no optimizer "
                              f"state")
    mine = type(optimizer).__name__
    if optim["class"] != mine:
        raise CheckpointError(f"sf.load: the checkpoint in {reader.dir!r} holds the state of "
                              f"a {optim['class']} optimizer, which cannot be loaded into a "
                              f"{mine}; build a {optim['class']}, or load the model alone "
                              f"(sf.load(path, model))")
    names = _param_names(model)
    groups = optim["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"sf.load: the checkpoint's optimizer has {len(groups)} parameter "
                              f"groups, this one {len(optimizer.param_groups)}")
    for i, (g, sg) in enumerate(zip(optimizer.param_groups, groups)):
        held = [names.get(id(p)) for p in g["params"]]
        if held != sg["params"]:
            raise CheckpointError(f"sf.load: parameter group {i} holds {held} but the "
                                  f"checkpoint's holds {sg['params']}")
    saved: dict[str, list] = {}
    for key in reader.manifest["tensors"]:
        if key.startswith("optim/"):
            pname, _, skey = key[len("optim/"):].rpartition("/")
            saved.setdefault(pname, []).append((skey, key))
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            pname = names[id(p)]
            for skey, key in saved.get(pname, []):
                _check_shape(reader, key, p, f"optimizer state {skey!r} of {pname!r}")
                out.append((key, p, skey))
    return out


def _load_optimizer(reader: _Reader, model: Module, optimizer, targets: list) -> None:
    """Replace ``optimizer``'s state and hyper-parameters by the checkpoint's (checked by
    `_plan_optimizer`; ``targets``: the optimizer's `_Target`s)."""
    optim = reader.common["optim"]
    names = _param_names(model)
    tensors: dict[int, list] = {}
    for x in targets:
        tensors.setdefault(id(x.tensor), []).append(x)
    new_state = type(optimizer.state)(dict) if hasattr(optimizer.state, "default_factory") \
        else {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            entry = dict(optim["scalars"].get(names[id(p)], {}))
            for x in tensors.get(id(p), []):
                dt = _files.dtype_of(x.key, reader.described(x.key)["dtype"])
                t = _sf_zeros(*p.shape, placement=p.placement, sbp=update_layout(p), dtype=dt)
                _restore(reader, x, t)
                entry[x.skey] = t
            if entry:
                new_state[p] = entry
    for g, sg in zip(optimizer.param_groups, optim["param_groups"]):
        for k, v in sg.items():
            if k != "params":
                g[k] = v
    optimizer.state = new_state
