"""Distributed checkpoints: ``sf.save(path_dir, model, optimizer, step=)`` and
``sf.load(path_dir, model, optimizer)``.

Layout of a checkpoint directory (all ranks share one file system)::

    manifest.json    written last by rank 0: the commit point (format, save id, world size,
                     step, every tensor's logical shape / dtype / placement / sbp)
    common.pt        rank 0: optimizer hyper-parameters and scalar state, sbpflow's seed stream
    rank{r}.pt       rank r's shards: {key: tensor}
    rank{r}.json     rank r's index: for each shard, the tensor's shape, dtype, placement and
                     sbp, the region (box) of the logical tensor the shard holds, and whether it
                     is a partial value (the reduction op)

Each file is written to a temporary name and moved into place with ``os.replace``. Replicas are
written once: a rank writes a tensor's shard only if it is the first rank along every mesh dim
that replicates it (``B``); partial-sum pieces (``P``) are all written. Keys: ``model/<name>``
(parameters and persistent buffers, `Module.state_dict` names) and ``optim/<param name>/<state
key>``.

``load`` fills the model's parameters (and the optimizer's state) in their CURRENT layouts, which
may differ from the saved ones in sbp, placement and world size: each rank reconstructs exactly
the region its shard covers from the saved pieces that intersect it (summing partial pieces),
reading other ranks' files memory-mapped, so no tensor is materialised beyond that region.
"""

from __future__ import annotations

import json
import os
import secrets

import torch

from .. import comm as _comm
from ..boxing import identity_value
from ..boxing.boxes import box_numel, box_shape, intersect, relative
from ..errors import SbpError, ShapeError
from ..sbp import Broadcast, Partial, format_nd_sbp, shard_box
from ..tensor import GlobalTensor, zeros as _sf_zeros
from .modules import Module

__all__ = ["save", "load", "CheckpointError"]

FORMAT = 1


class CheckpointError(SbpError, RuntimeError):
    """A checkpoint directory is missing, incomplete, mixed, or does not fit the model."""


# -- helpers --------------------------------------------------------------------------------------
def _write_atomic(path: str, write) -> None:
    tmp = f"{path}.tmp-{os.getpid()}-{_comm.rank()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _write_file(path: str, mode: str, dump) -> None:
    """Write ``path`` atomically and durably: ``dump(file)`` into a temp file, fsync, rename."""
    def write(tmp):
        with open(tmp, mode) as f:
            dump(f)
            f.flush()
            os.fsync(f.fileno())
    _write_atomic(path, write)


def _write_json(path: str, obj) -> None:
    _write_file(path, "w", lambda f: json.dump(obj, f))


def _write_torch(path: str, obj) -> None:
    _write_file(path, "wb", lambda f: torch.save(obj, f))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in checkpoint")
    return dt


def _describe(t: GlobalTensor) -> dict:
    return {"shape": list(t.shape), "dtype": _dtype_name(t.dtype),
            "placement": {"device_type": t.placement.device_type, "ranks": t.placement.ranks},
            "sbp": [repr(s) for s in t.sbp]}


def _agree_id() -> int:
    """A fresh id drawn by rank 0 and broadcast to every rank (also a synchronisation point)."""
    comm = _comm.current()
    value = secrets.randbits(62) if comm.rank == 0 else 0
    out = comm.broadcast(torch.tensor([value], dtype=torch.int64), 0,
                         tuple(range(comm.world_size)))
    return int(out[0])


def _param_names(model: Module) -> dict:
    return {id(p): n for n, p in model.named_parameters()}


def _tensors(model: Module, optimizer) -> list[tuple[str, GlobalTensor]]:
    """(key, tensor) for everything saved, in the same order on every rank."""
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


# -- save -----------------------------------------------------------------------------------------
def save(path_dir: str, model: Module, optimizer=None, step: int | None = None,
         extra: dict | None = None) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``) to directory ``path_dir``. Every
    rank must call it; each writes its own shards. ``extra``: small JSON-able data kept in the
    manifest (returned by `load` through ``info=``)."""
    comm = _comm.current()
    me, world = comm.rank, comm.world_size
    os.makedirs(path_dir, exist_ok=True)
    manifest_path = os.path.join(path_dir, "manifest.json")
    if me == 0 and os.path.exists(manifest_path):
        os.remove(manifest_path)  # the old checkpoint is no longer complete from here on
    save_id = _agree_id()
    items = _tensors(model, optimizer)
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
    _write_torch(os.path.join(path_dir, f"rank{me}.pt"), {"save_id": save_id, "rank": me,
                                                         "tensors": shards})
    _write_json(os.path.join(path_dir, f"rank{me}.json"),
                {"save_id": save_id, "rank": me, "entries": index})
    if me == 0:
        common = {"save_id": save_id, "optim": None,
                  "rng": [comm.state.get("seed", 0), comm.state.get("seed_counter", 0)]}
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
        _write_torch(os.path.join(path_dir, "common.pt"), common)
    comm.barrier()
    if me == 0:
        _write_json(manifest_path, {
            "format": FORMAT, "save_id": save_id, "world_size": world, "step": step,
            "extra": extra, "tensors": {k: _describe(t) for k, t in items}})
    comm.barrier()


# -- load -----------------------------------------------------------------------------------------
class _Reader:
    """The saved pieces of every key, and their files opened (memory-mapped) on demand."""

    def __init__(self, path_dir: str) -> None:
        self.dir = path_dir
        mpath = os.path.join(path_dir, "manifest.json")
        if not os.path.exists(mpath):
            raise CheckpointError(f"no complete checkpoint in {path_dir!r} (manifest.json is "
                                  f"missing: the save did not finish, or this is not a "
                                  f"checkpoint directory)")
        with open(mpath) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise CheckpointError(f"{mpath}: unknown checkpoint format "
                                  f"{self.manifest.get('format')!r}")
        self.save_id = self.manifest["save_id"]
        self.pieces: dict[str, list] = {}
        for r in range(self.manifest["world_size"]):
            with open(os.path.join(path_dir, f"rank{r}.json")) as f:
                meta = json.load(f)
            if meta["save_id"] != self.save_id:
                raise CheckpointError(f"{path_dir}/rank{r}.json belongs to another save than "
                                      f"manifest.json (mixed checkpoint)")
            for key, e in meta["entries"].items():
                self.pieces.setdefault(key, []).append(
                    (r, tuple(tuple(b) for b in e["box"]), e["partial"]))
        self._files: dict[int, dict] = {}
        self._common = None

    @property
    def common(self) -> dict:
        if self._common is None:
            self._common = torch.load(os.path.join(self.dir, "common.pt"), weights_only=True)
            if self._common["save_id"] != self.save_id:
                raise CheckpointError(f"{self.dir}/common.pt belongs to another save than "
                                      f"manifest.json (mixed checkpoint)")
        return self._common

    def _file(self, r: int) -> dict:
        if r not in self._files:
            data = torch.load(os.path.join(self.dir, f"rank{r}.pt"), mmap=True,
                              weights_only=True, map_location="cpu")
            if data["save_id"] != self.save_id:
                raise CheckpointError(f"{self.dir}/rank{r}.pt belongs to another save than "
                                      f"manifest.json (mixed checkpoint)")
            self._files[r] = data["tensors"]
        return self._files[r]

    def described(self, key: str) -> dict | None:
        return self.manifest["tensors"].get(key)

    def region(self, key: str, box: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The logical values of ``box`` of saved tensor ``key``."""
        pieces = self.pieces.get(key, [])
        ops = {op for _, _, op in pieces}
        op = next(iter(ops)) if len(ops) == 1 else None
        if len(ops) > 1:
            raise CheckpointError(f"{key}: saved pieces disagree on their reduction: {ops}")
        shape = box_shape(box)
        if op in ("max", "min"):
            out = torch.full(shape, identity_value(op, dtype), dtype=dtype)
        else:
            out = torch.zeros(shape, dtype=dtype)
        covered = 0
        for r, pbox, _ in pieces:
            inter = intersect(box, pbox)
            n = box_numel(inter)
            if n == 0:
                continue
            src = self._file(r)[key][relative(inter, pbox)].to(dtype)
            dst = out[relative(inter, box)]
            if op is None:
                dst.copy_(src)
                covered += n
            elif op == "sum":
                dst.add_(src)
            elif op == "max":
                torch.maximum(dst, src, out=dst)
            else:
                torch.minimum(dst, src, out=dst)
        if op is None and covered != box_numel(box):
            raise CheckpointError(f"{key}: the checkpoint's pieces cover {covered} of the "
                                  f"{box_numel(box)} elements of region {box} (corrupt or "
                                  f"incomplete checkpoint)")
        return out


def _restore(reader: _Reader, key: str, t: GlobalTensor) -> None:
    """Fill ``t``'s shard (its current layout) from saved tensor ``key``."""
    me = _comm.rank()
    if me not in t.placement:
        return
    coord = t.placement.coord_of(me)
    local = t.local
    with torch.no_grad():
        partial = [(s, c) for s, c in zip(t.sbp, coord) if isinstance(s, Partial)]
        if any(c != 0 for _, c in partial):
            local.fill_(identity_value(partial[0][0].op, local.dtype))
            return
        box = shard_box(tuple(t.shape), t.placement.shape, t.sbp, coord)
        local.copy_(reader.region(key, box, local.dtype).reshape(local.shape))


def _check_shape(reader: _Reader, key: str, t: GlobalTensor, what: str) -> None:
    d = reader.described(key)
    if tuple(d["shape"]) != tuple(t.shape):
        raise ShapeError(f"sf.load: {what} has shape {tuple(d['shape'])} in the checkpoint "
                         f"(saved on {d['placement']['ranks']} with sbp {d['sbp']}) but "
                         f"{tuple(t.shape)} in the model (placement {t.placement}, sbp "
                         f"{format_nd_sbp(t.sbp)})")


def load(path_dir: str, model: Module, optimizer=None, *, strict: bool = True,
         restore_rng: bool = True, info: dict | None = None):
    """Load a checkpoint written by `save` into ``model`` (and ``optimizer``) in their current
    layouts; returns the saved ``step``. Every rank must call it (no communication besides a
    final barrier). ``strict``: model keys missing from the checkpoint (or extra ones) raise
    `CheckpointError`. ``info``: a dict filled with the manifest's ``extra`` and ``world_size``.
    """
    reader = _Reader(path_dir)
    model_items = model._state_items()
    saved_model = {k[len("model/"):] for k in reader.manifest["tensors"] if k.startswith("model/")}
    missing = [k for k, _ in model_items if k not in saved_model]
    unexpected = sorted(saved_model - {k for k, _ in model_items})
    if strict and (missing or unexpected):
        raise CheckpointError(f"sf.load from {path_dir!r}: the model's keys missing from the "
                              f"checkpoint: {missing}; keys in the checkpoint the model lacks: "
                              f"{unexpected}")
    for k, t in model_items:
        if k in saved_model:
            _check_shape(reader, f"model/{k}", t, f"tensor {k!r}")
    if optimizer is not None:
        optim = reader.common["optim"]
        if optim is None:
            raise CheckpointError(f"sf.load: the checkpoint in {path_dir!r} has no optimizer "
                                  f"state")
        _load_optimizer(reader, model, optimizer, optim)
    for k, t in model_items:
        if k in saved_model:
            _restore(reader, f"model/{k}", t)
    if restore_rng:
        seed, counter = reader.common["rng"]
        state = _comm.current().state
        state["seed"], state["seed_counter"] = int(seed), int(counter)
    if info is not None:
        info.update(extra=reader.manifest.get("extra"), world_size=reader.manifest["world_size"])
    _comm.current().barrier()
    return reader.manifest.get("step")


def _load_optimizer(reader: _Reader, model: Module, optimizer, optim: dict) -> None:
    names = _param_names(model)
    groups = optim["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"sf.load: the checkpoint's optimizer has {len(groups)} parameter "
                              f"groups, this one {len(optimizer.param_groups)}")
    for i, (g, sg) in enumerate(zip(optimizer.param_groups, groups)):
        mine = [names.get(id(p)) for p in g["params"]]
        if mine != sg["params"]:
            raise CheckpointError(f"sf.load: parameter group {i} holds {mine} but the "
                                  f"checkpoint's holds {sg['params']}")
    prefix = "optim/"
    saved = {}
    for key in reader.manifest["tensors"]:
        if key.startswith(prefix):
            pname, _, skey = key[len(prefix):].rpartition("/")
            saved.setdefault(pname, []).append((skey, key))
    new_state = type(optimizer.state)(dict) if hasattr(optimizer.state, "default_factory") \
        else {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            pname = names[id(p)]
            entry = dict(optim["scalars"].get(pname, {}))
            for skey, key in saved.get(pname, []):
                _check_shape(reader, key, p, f"optimizer state {skey!r} of {pname!r}")
                dt = _dtype(reader.described(key)["dtype"])
                t = _sf_zeros(*p.shape, placement=p.placement, sbp=p.sbp, dtype=dt)
                _restore(reader, key, t)
                entry[skey] = t
            if entry:
                new_state[p] = entry
    for g, sg in zip(optimizer.param_groups, groups):
        for k, v in sg.items():
            if k != "params":
                g[k] = v
    optimizer.state = new_state
