"""The files of a Hugging Face checkpoint: safetensors written one tensor at a time, the shard
plan and index of ``save_pretrained``, and a reader of single-file or sharded checkpoints that
reads regions (``safe_open(...).get_slice``). No communication here (`safetensors_io` runs the
collectives). See docs/huggingface.md, 'Checkpoints for the ecosystem'.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import struct
from typing import NamedTuple

import torch

from .checkpoint_files import CheckpointError, fsync_dir

__all__ = ["Entry", "SINGLE", "INDEX", "DEFAULT_MAX_SHARD_SIZE", "parse_size", "plan_shards",
           "index_text", "remove_stale", "StreamWriter", "Source"]

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "50GB"   # transformers 5's save_pretrained default
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}   # huggingface_hub's units

_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
          torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
          torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3",
          torch.float8_e5m2: "F8_E5M2", torch.complex64: "C64"}
_DTYPES = {code: dt for dt, code in _CODES.items()}


class Entry(NamedTuple):
    """One tensor of the checkpoint: its name, logical shape and dtype."""
    name: str
    shape: tuple
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


def dtype_code(dtype: torch.dtype, name: str) -> str:
    """safetensors' name of ``dtype`` ("F32"); `CheckpointError` for a dtype it has none of."""
    code = _CODES.get(dtype)
    if code is None:
        raise CheckpointError(f"tensor {name!r}: safetensors has no dtype {dtype} (it stores "
                              f"{sorted(str(d) for d in _CODES)}); cast the model first")
    return code


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int, or digits and a unit as transformers takes them ("5MB":
    5 000 000; TB, GB, MB, KB)."""
    if isinstance(size, int) and size > 0:
        return size
    text = str(size).strip()
    unit, value = text[-2:].upper(), text[:-2].strip()
    try:
        n = int(float(value) * _UNITS[unit])
    except (KeyError, ValueError):
        n = 0
    if n <= 0:
        raise CheckpointError(f"max_shard_size={size!r}: give a positive number of bytes or "
                              f"digits and a unit (TB, GB, MB, KB), as '5GB'")
    return n


def plan_shards(entries: list[Entry], max_size: int) -> dict[str, list[Entry]]:
    """``{file name: entries}`` as transformers' ``save_pretrained`` splits a state dict
    (huggingface_hub's ``split_torch_state_dict_into_shards``): in order, a new file when the
    next tensor would take the current one over ``max_size``, a tensor larger than that in a
    file of its own; one file is `SINGLE`, several ``model-0000i-of-0000n.safetensors``."""
    shards, current, size = [], [], 0
    for e in entries:
        if e.nbytes > max_size:
            shards.append([e])
            continue
        if current and size + e.nbytes > max_size:
            shards.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current or not shards:
        shards.append(current)
    if len(shards) == 1:
        return {SINGLE: shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards)}


def index_text(files: dict[str, list[Entry]], total_parameters: int) -> str:
    """``model.safetensors.index.json`` as transformers writes it: ``metadata`` (total
    parameters, total bytes) and ``weight_map`` (tensor name -> file), sorted, indented."""
    weight_map = {e.name: f for f, es in files.items() for e in es}
    total = sum(e.nbytes for es in files.values() for e in es)
    index = {"metadata": {"total_parameters": total_parameters, "total_size": total},
             "weight_map": weight_map}
    return json.dumps(index, indent=2, sort_keys=True) + "\n"


def remove_stale(path_dir: str, keep: set) -> None:
    """Remove the weight files of an earlier export that this one does not write: other
    ``model-*-of-*`` shards, and the single file or the index when the layout changed."""
    for name in os.listdir(path_dir):
        if name in keep:
            continue
        if _SHARD.fullmatch(name) or name in (SINGLE, INDEX):
            os.remove(os.path.join(path_dir, name))


class StreamWriter:
    """A safetensors file written as its tensors arrive: the header first (names, dtypes,
    shapes, offsets: known from the metadata alone), then each tensor's bytes in header order.
    Written under a temporary name and renamed when complete (`close`); `abort` removes it."""

    def __init__(self, path: str, entries: list[Entry], metadata: dict) -> None:
        self.path, self.entries, self.done = path, list(entries), 0
        self.tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        header, offset = {"__metadata__": dict(metadata)}, 0
        for e in self.entries:
            header[e.name] = {"dtype": dtype_code(e.dtype, e.name), "shape": list(e.shape),
                              "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)   # the data starts 8-byte aligned, as safetensors pads
        self.file = open(self.tmp, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, value: torch.Tensor) -> None:
        """Append the next entry's value (its shape and dtype checked)."""
        e = self.entries[self.done]
        if tuple(value.shape) != e.shape or value.dtype != e.dtype:
            raise CheckpointError(f"tensor {e.name!r}: got {tuple(value.shape)} {value.dtype}, "
                                  f"the header says {e.shape} {e.dtype}")
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            self.file.write(memoryview(flat.view(torch.uint8).numpy()))
        self.done += 1

    def close(self) -> None:
        """Flush, fsync and rename the complete file into place."""
        if self.done != len(self.entries):
            raise CheckpointError(f"{self.path}: {self.done} of {len(self.entries)} tensors "
                                  f"written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(os.path.dirname(self.path) or ".")

    def abort(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            os.remove(self.tmp)


class Source:
    """A Hugging Face checkpoint to read: a directory holding `SINGLE` or `INDEX` and its
    shards, or one ``.safetensors`` file. `entries` reads the headers only; `read` reads one
    region of one tensor (``get_slice``), nothing else. Close it (a context manager)."""

    def __init__(self, path: str) -> None:
        try:
            import safetensors
        except ImportError:
            raise CheckpointError("reading safetensors needs the safetensors package (pip "
                                  "install safetensors, or sbpflow's hf extra)") from None
        self.path, self._safetensors = path, safetensors
        self._stack, self._open = contextlib.ExitStack(), {}
        self.files = self._files(path)            # file path -> names the index gives it
        self.where: dict[str, str] = {}
        self.entries: dict[str, Entry] = {}

    def _files(self, path: str) -> dict[str, list | None]:
        if os.path.isfile(path):
            return {path: None}
        if os.path.isfile(os.path.join(path, INDEX)):
            with open(os.path.join(path, INDEX), encoding="utf-8") as f:
                try:
                    weight_map = json.load(f)["weight_map"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise CheckpointError(f"{path}/{INDEX}: not an index of safetensors "
                                          f"shards ({exc!r})") from None
            out: dict[str, list] = {}
            for name, file in weight_map.items():
                out.setdefault(os.path.join(path, file), []).append(name)
            return out
        if os.path.isfile(os.path.join(path, SINGLE)):
            return {os.path.join(path, SINGLE): None}
        held = sorted(os.listdir(path)) if os.path.isdir(path) else "no such directory"
        raise CheckpointError(f"{path!r} holds no Hugging Face checkpoint: neither {SINGLE} "
                              f"nor {INDEX} (it holds {held})")

    def handle(self, file: str):
        if file not in self._open:
            if not os.path.isfile(file):
                raise CheckpointError(f"{file} is missing (named by {self.path}/{INDEX})")
            self._open[file] = self._stack.enter_context(
                self._safetensors.safe_open(file, framework="pt"))
        return self._open[file]

    def read_headers(self) -> dict[str, Entry]:
        """Every tensor's `Entry` (headers only); `CheckpointError` where the index and the
        files disagree or a dtype is unknown."""
        for file, named in self.files.items():
            f = self.handle(file)
            keys = list(f.keys())
            if named is not None and not set(named) <= set(keys):
                raise CheckpointError(f"{file} lacks {sorted(set(named) - set(keys))}, which "
                                      f"{self.path}/{INDEX} places there")
            for k in keys if named is None else named:
                s = f.get_slice(k)
                code = s.get_dtype()
                if code not in _DTYPES:
                    raise CheckpointError(f"{file}: tensor {k!r} has dtype {code}, which "
                                          f"torch cannot hold")
                self.where[k] = file
                self.entries[k] = Entry(k, tuple(s.get_shape()), _DTYPES[code])
        return self.entries

    def read(self, name: str, box: tuple) -> torch.Tensor:
        """The region ``box`` (``((start, size), ...)`` per axis) of tensor ``name``."""
        f = self.handle(self.where[name])
        if not box:
            return f.get_tensor(name)
        return f.get_slice(name)[tuple(slice(s, s + n) for s, n in box)]

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
