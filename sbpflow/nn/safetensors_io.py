"""Checkpoints in the Hugging Face format. ``sf.export(model, dir)`` writes a model in any layout
as ``save_pretrained`` does (``model.safetensors``, or shards and their index above
``max_shard_size``; ``config.json`` and ``generation_config.json``), gathering one tensor at a
time to the writer rank, which alone writes. `load_safetensors` reads such a checkpoint into
the model's current layouts, each rank reading only its shards' bytes (``get_slice``).
See docs/huggingface.md, 'Checkpoints for the ecosystem'.
"""

from __future__ import annotations

import copy
import os
import re
import sys

import torch

from .. import comm as _comm
from ..errors import CheckpointKeyError, SbpError
from ..param_state import mark_stale
from ..placement import Placement
from ..sbp import B, format_nd_sbp
from ..tensor import GlobalTensor
from .checkpoint_files import CheckpointError, CheckpointShapeError, canonical_crc
from .init import materialize
from .modules import Module
from .safetensors_files import (DEFAULT_MAX_SHARD_SIZE, INDEX, Entry, Source, StreamWriter,
                                index_text, parse_size, plan_shards, remove_stale)
from .serialization import _agree, _box_to_read

__all__ = ["export", "load_safetensors", "WRITER"]

WRITER = 0   # the rank that writes an export's files (it alone holds a whole tensor, one at a time)


def _check_model(what: str, model) -> None:
    if not isinstance(model, Module):
        raise CheckpointError(f"{what}: model must be an sf.nn.Module (convert a torch model "
                              f"with sf.parallel.apply or sf.nn.from_torch; a plain torch "
                              f"model saves itself with save_pretrained), got "
                              f"{type(model).__module__}.{type(model).__name__}")


def _tied_patterns(model: Module) -> list[str]:
    """The names transformers declares tied (``_tied_weights_keys`` of every submodule, a
    dict ``{tied: source}`` in transformers 5, a list before), as regular expressions."""
    out = []
    for name, m in model.named_modules():
        tied = getattr(m, "_tied_weights_keys", None) or ()
        out += [f"{name}.{k}" if name else k for k in tied]
    return out


def _written(model: Module) -> list[tuple[str, GlobalTensor]]:
    """(name, tensor) to write, in state-dict order: a tensor under several names (tied
    weights) once, under the name transformers keeps (`save_pretrained`'s
    ``remove_tied_weights_from_state_dict``: the names matching a declared tie are dropped
    while one name is left); ``_keys_to_ignore_on_save`` dropped."""
    items = model._state_items()
    patterns = _tied_patterns(model)
    names_of: dict[int, list] = {}
    for k, t in items:
        names_of.setdefault(id(t), []).append(k)
    drop = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    for names in names_of.values():
        if len(names) > 1:
            tied = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
            drop.update(tied[:-1] if len(tied) == len(names) else tied)
    out = [(k, t) for k, t in items if k not in drop]
    conversion = _renaming(model, saving=True)
    if conversion is None:
        return out
    rename, order = conversion   # save_pretrained writes a converted model in this order
    return [(rename(k), t) for k, t in sorted(out, key=lambda kt: order(kt[0]))]


def _renaming(model: Module, saving: bool) -> tuple | None:
    """transformers 5's renaming of checkpoint names for ``model``'s architecture (GPT-NeoX's
    ``embed_out`` <-> ``lm_head``; legacy ``LayerNorm.gamma``): ``(rename, order)``, the
    function from a file's name to the model's (``saving``: the reverse, as ``save_pretrained``
    writes the original names) and the sort key of names ``save_pretrained`` then writes in;
    None where there is none. Its converters that merge or split tensors (MoE experts) are
    not applied: such tensors are not found (`CheckpointKeyError` names them)."""
    tf = sys.modules.get("transformers")
    if tf is None or not isinstance(model, tf.PreTrainedModel):
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping as mapping
    from transformers.core_model_loading import WeightRenaming, apply_renamings, dot_natural_key
    # the model's own mapping, by its transformers class, else its model type (as
    # get_model_conversion_mapping, which takes a converted class for custom code), legacy
    # names too on load; prefixes are `_file_name`'s
    cls = next(c for c in type(model).__mro__ if c.__module__.startswith("transformers."))
    steps = mapping(cls.__name__) or mapping(getattr(model.config, "model_type", None)) or []
    steps = [c for c in steps + ([] if saving else mapping("legacy") or [])
             if type(c).__name__ != "PrefixChange"]
    if saving:
        steps = [c.reverse_transform() for c in steps[::-1]]
    if not steps:
        return None
    renamings = [c for c in steps if isinstance(c, WeightRenaming)]
    return (lambda name: apply_renamings(name, renamings)), dot_natural_key


def export(model: Module, path_dir: str, *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
           metadata: dict | None = None) -> list[str]:
    """Write ``model`` (any layout: split, replicated, partial, N-D meshes, ZeRO-3, pipeline
    stages) to directory ``path_dir`` as a Hugging Face checkpoint that
    ``AutoModel*.from_pretrained(path_dir)`` (and ``safetensors``) load: the logical value of
    every parameter and persistent buffer under its state-dict name, tied weights once
    (under the name transformers keeps), in ``model.safetensors``, or above ``max_shard_size``
    (bytes, or "5GB"; transformers' default 50GB) in ``model-0000i-of-0000n.safetensors`` with
    ``model.safetensors.index.json``; file metadata ``{"format": "pt", **metadata}``; the
    model's ``config`` (``config.json``, ``dtype`` and ``architectures`` set as
    ``save_pretrained`` sets them) and ``generation_config`` where it generates.

    A collective: every rank calls it. Tensor by tensor, each is boxed to ``B`` on rank
    `WRITER` alone (each rank sends its shard there, point to point; nothing is gathered on
    the others), written, and freed; rank `WRITER` writes every file (each under a temporary
    name, renamed when complete; stale shards of an earlier export are removed). A failure on
    any rank raises on every rank. Returns the weight files' names."""
    _check_model("sf.export", model)
    me, files, error = _comm.rank(), {}, None
    written = _written(model)
    try:
        entries = [Entry(k, tuple(t.shape), t.dtype) for k, t in written]
        files = plan_shards(entries, parse_size(max_shard_size))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (metadata or {}).items()):
            raise CheckpointError(f"sf.export: metadata must map strings to strings (the "
                                  f"safetensors header's), got {metadata!r}")
        if me == WRITER:
            os.makedirs(path_dir, exist_ok=True)
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
        error = exc
    what = f"sf.export to {path_dir!r}"
    crc = canonical_crc([[k, list(t.shape), str(t.dtype)] for k, t in written])
    rows = _agree(_wrapped(error, what), what, (crc,))
    if any(r[0] != rows[0][0] for r in rows):
        raise CheckpointError(f"{what}: the ranks export different tensors (names, shapes or "
                              f"dtypes); every rank must pass the same model")
    error = _stream(path_dir, files, dict(written), {"format": "pt", **(metadata or {})})
    if me == WRITER and error is None:
        try:
            _write_rest(model, path_dir, files, written)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
            error = exc
    _agree(_wrapped(error, what), what)
    return list(files)


def _wrapped(error: Exception | None, what: str) -> Exception | None:
    """``error`` as a `CheckpointError` (an `SbpError` on every rank) saying which rank could
    not write, caused by the file system's error; an `SbpError` as it is."""
    if error is None or isinstance(error, SbpError):
        return error
    out = CheckpointError(f"{what}: rank {_comm.rank()} could not write the files: {error!r}")
    out.__cause__ = error
    return out


def _gather(t) -> torch.Tensor | None:
    """Collective: ``t``'s logical value on rank `WRITER` (None elsewhere), boxed to ``B`` on
    that rank alone: the other ranks only send their shards."""
    if not isinstance(t, GlobalTensor):
        return t.detach() if _comm.rank() == WRITER else None
    with torch.no_grad():
        q = t.to_global(placement=Placement(t.placement.device_type, [WRITER]), sbp=(B,))
    return q.local.detach() if _comm.rank() == WRITER else None


def _stream(path_dir: str, files: dict, tensors: dict, metadata: dict) -> Exception | None:
    """Collective: every file's tensors gathered (`_gather`) in order, rank `WRITER` writing
    each as it arrives; returns rank WRITER's error (it keeps gathering after one, so no rank
    waits for it), else None."""
    error = None
    for name, entries in files.items():
        writer = None
        if _comm.rank() == WRITER and error is None:
            try:
                writer = StreamWriter(os.path.join(path_dir, name), entries, metadata)
            except Exception as exc:  # noqa: BLE001 - reported after the gathers
                error = exc
        for e in entries:
            value = _gather(tensors[e.name])
            if writer is not None and error is None:
                try:
                    writer.write(value)
                except Exception as exc:  # noqa: BLE001 - reported after the gathers
                    error = exc
            del value
        if writer is not None:
            try:
                writer.close() if error is None else writer.abort()
            except Exception as exc:  # noqa: BLE001 - reported after the gathers
                error = exc
    return error


def _write_rest(model: Module, path_dir: str, files: dict, written: list) -> None:
    """Rank `WRITER`, once the weights are written: the index (sharded), stale weight files
    removed, the config and generation config."""
    if len(files) > 1:
        total = sum(p.numel() for p in model.parameters())
        with open(os.path.join(path_dir, INDEX), "w", encoding="utf-8") as f:
            f.write(index_text(files, total))
    remove_stale(path_dir, set(files) | ({INDEX} if len(files) > 1 else set()))
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    floats = [t.dtype for _, t in written if t.dtype.is_floating_point]
    if floats:
        config.dtype = str(floats[0]).split(".")[1]
    config.architectures = [type(model).__name__]
    config.save_pretrained(path_dir)
    can_generate = getattr(model, "can_generate", None)
    generation = getattr(model, "generation_config", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(path_dir)


# -- load -----------------------------------------------------------------------------------------
def load_safetensors(model: Module, path: str, *, strict: bool = True,
                     info: dict | None = None) -> Module:
    """Fill ``model``'s parameters and persistent buffers, in their CURRENT layouts, from the
    Hugging Face checkpoint at ``path`` (a directory with ``model.safetensors`` or an index
    and its shards, or one ``.safetensors`` file); returns ``model``. Each rank reads only the
    region of each tensor its shard holds (``safe_open(...).get_slice``: the local shard of
    DESIGN.md, balanced parts, uneven sizes, N-D meshes, ZeRO-3's split storage), cast to the
    model's dtype; nothing is communicated but one agreement. Names as the model's state
    dict, after transformers' renamings of the architecture (`_renaming`); a name found only
    without (or with) the model's ``base_model_prefix`` is read from there, as transformers
    does; tied weights are filled once, from any of their names. Storage-less (``meta``)
    buffers are given storage first, the non-persistent ones values by `_compute_buffers`.

    A collective: every rank calls it. Everything is checked before anything is read, and a
    problem raises on every rank with the model unchanged: `CheckpointShapeError` (names,
    both shapes, the layout), and, with ``strict``, `CheckpointKeyError` naming the model's
    tensors the checkpoint lacks and the checkpoint's tensors the model lacks (those matching
    transformers' ``_keys_to_ignore_on_load_missing`` / ``_unexpected`` excepted). ``info``:
    a dict filled with ``missing`` and ``unexpected`` names."""
    _check_model("sf.load_pretrained", model)
    source, targets, missing, unexpected, error = None, [], [], [], None
    try:
        source = Source(path)
        targets, missing, unexpected = _plan_load(model, source.read_headers(), path)
        if strict and (missing or unexpected):
            raise CheckpointKeyError(
                f"sf.load_pretrained from {path!r}: the model's tensors missing from the "
                f"checkpoint: {missing}; tensors in the checkpoint the model lacks: "
                f"{unexpected} (strict=False loads the others)")
    except Exception as exc:  # noqa: BLE001 - every rank must learn of it (_agree)
        error = exc
    try:
        _agree(error, f"sf.load_pretrained from {path!r}")
        # buffers first: an _init_weights that also draws a module's parameters is overwritten
        _compute_buffers(model, _materialize_buffers(model))
        for key, t in targets:
            _fill(source, key, t)
    finally:
        if source is not None:
            source.close()
    if info is not None:
        info.update(missing=missing, unexpected=unexpected)
    _comm.current().barrier()
    return model


def _ignored(model: Module, attr: str, name: str) -> bool:
    """Whether ``name`` matches one of the model's transformers patterns ``attr``."""
    return any(re.search(p, name) for p in getattr(model, attr, None) or ())


def _file_name(model: Module, key: str, names: dict) -> str | None:
    """The checkpoint's name of the model's tensor ``key`` (``names``: the model's name of
    each file name, `_renaming`, to the file name): ``key``, else without or with the model's
    ``base_model_prefix`` (a base model's checkpoint in a model with a head, or the
    reverse), else None."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    for k in (key, key[len(prefix) + 1:] if prefix and key.startswith(prefix + ".") else None,
              f"{prefix}.{key}" if prefix else None):
        if k is not None and k in names:
            return names[k]
    return None


def _plan_load(model: Module, entries: dict, path: str) -> tuple[list, list, list]:
    """``([(checkpoint name, tensor)], missing, unexpected)``: each of the model's tensors
    once (a tied one under the first of its names the checkpoint has); `CheckpointShapeError`
    for every tensor whose shape differs, all named together."""
    items = model._state_items()
    conversion = _renaming(model, saving=False)
    names = {n: n for n in entries} if conversion is None else \
        {conversion[0](n): n for n in entries}
    found: dict[int, tuple] = {}
    used, bad = set(), []
    for k, t in items:
        name = _file_name(model, k, names)
        if name is None or id(t) in found:
            continue
        used.add(name)
        found[id(t)] = (name, t)
        e = entries[name]
        if e.shape != tuple(t.shape):
            bad.append(f"{k!r}: {e.shape} in the checkpoint ({name!r}, {e.dtype}), "
                       f"{tuple(t.shape)} in the model (placement {t.placement}, sbp "
                       f"{format_nd_sbp(t.sbp)})")
    if bad:
        raise CheckpointShapeError(f"sf.load_pretrained from {path!r}: shapes differ: "
                                   + "; ".join(bad) + "; build the model with the "
                                   f"checkpoint's config")
    missing = [k for k, t in items if id(t) not in found
               and not _ignored(model, "_keys_to_ignore_on_load_missing", k)]
    unexpected = [n for n in entries if n not in used
                  and not _ignored(model, "_keys_to_ignore_on_load_unexpected", n)]
    return list(found.values()), missing, unexpected


def _fill(source: Source, name: str, t: GlobalTensor) -> None:
    """``t``'s shard read from checkpoint tensor ``name``: the region this rank holds (zeros
    where a partial layout gives it none), nothing else."""
    if not isinstance(t, GlobalTensor):
        with torch.no_grad():
            t.copy_(source.read(name, tuple((0, n) for n in t.shape)))
        return
    if _comm.rank() not in t.placement:
        return
    mark_stale(t)   # a ZeRO-2 parameter's whole copy is gathered again before its next use
    box = _box_to_read(t)
    local = t.local
    with torch.no_grad():
        if box is None:
            local.zero_()
        elif local.numel():
            local.copy_(source.read(name, box).to(local.dtype).reshape(local.shape))


def _materialize_buffers(model: Module) -> list:
    """Give every storage-less buffer (a model built on torch's ``meta`` device) storage in its
    layout, zeros (the file fills the persistent ones); returns the modules holding such a
    non-persistent buffer, which `_compute_buffers` fills."""
    computed = []
    for m in model.modules():
        for k, b in list(m._buffers.items()):
            if isinstance(b, GlobalTensor) and b.local.is_meta:
                m._buffers[k] = materialize(b)
                if k in m._non_persistent and m not in computed:
                    computed.append(m)
    return computed


def _compute_buffers(model: Module, modules: list) -> None:
    """The non-persistent buffers a checkpoint does not hold (rotary frequencies, position
    ids) of a model built on the ``meta`` device, computed as transformers computes them on
    load: the model's ``_init_weights`` of each module holding one. `CheckpointError` naming
    them where the model has no such method."""
    if not modules:
        return
    init = getattr(model, "_init_weights", None)
    if not callable(init):
        names = [f"{type(m).__name__}.{k}" for m in modules for k in m._buffers
                 if k in m._non_persistent]
        raise CheckpointError(f"sf.load_pretrained: the non-persistent buffers {names} were "
                              f"built on the meta device and no checkpoint holds them; build "
                              f"them with values (not under torch.device('meta'))")
    for m in modules:
        init(m)
