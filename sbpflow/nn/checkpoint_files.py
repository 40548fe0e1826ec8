"""The files of a checkpoint folder: checksummed durable writes, the manifest (the commit point,
which carries a checksum of its own body), verification on read, generations and their cleaning.

``manifest.json`` names the *generation* directory (``gen-<save id in hex>``) whose files make
up the committed checkpoint, with each file's size and crc32, and the one it replaced
(``previous``, kept until the next save). A save writes a fresh generation, then replaces the
manifest atomically. Saves run one at a time: rank 0 of each holds the folder's `WriterLock`
(``fcntl.flock``) from before any file is written until after its clean-up; under it a save
removes what killed saves left (`prune`), a failed save its own generation (`discard`), and
running out of space is an ``OSError`` with its errno (`write_file`, `out_of_space`). Every
check raises `CheckpointError` naming the file and what is wrong with it. See
docs/internals.md, 'Checkpoints (`nn/serialization.py`)'.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
import warnings
import zlib
from typing import Any, Callable

import torch

from ..errors import CheckpointError, CheckpointShapeError

try:
    import fcntl
except ImportError:  # not POSIX: saves are not locked (a warning says so)
    fcntl = None

__all__ = ["CheckpointError", "FORMAT", "MANIFEST", "generation_name", "write_file",
           "fsync_dir", "check_size", "verify_file", "read_verified", "parse_json",
           "canonical_crc", "encode_manifest", "write_manifest", "read_manifest_bytes",
           "parse_manifest", "read_manifest", "validate_manifest", "validate_tensor",
           "dtype_of", "validate_rank_index", "validate_common", "validate_shards", "clean",
           "referenced_generation", "check", "is_int", "LOCK", "LOCK_FILES", "WriterLock", "prune",
           "discard", "out_of_space", "free_bytes", "CheckpointShapeError"]

FORMAT = 2  # 1: files at the top of the folder, no checksums (still loaded, unverified)
MANIFEST = "manifest.json"
LOCK = "writer.lock"  # flocked by the saving writer, names it (host, pid); never removed
_QUEUE = "writer.wait"  # flocked by the writer that waits next (waiters are served in turn)
LOCK_FILES = (LOCK, _QUEUE)  # the folder's files that are no part of any checkpoint
_CHUNK = 4 << 20  # bytes read at a time when verifying a checksum
_GEN = re.compile(r"gen-[0-9a-f]{16}")
_LEGACY = re.compile(r"common\.pt|rank\d+\.(pt|json)")
_TEMP = re.compile(r"(common\.pt|rank\d+\.(pt|json)|manifest\.json)\.tmp-.*")


def check(ok: bool, where: str, what: str) -> None:
    """Raise `CheckpointError` ``"<where>: <what>"`` unless ``ok``."""
    if not ok:
        raise CheckpointError(f"{where}: {what}")


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def generation_name(save_id: int) -> str:
    return f"gen-{save_id:016x}"


# -- writing --------------------------------------------------------------------------------------
class _CrcWriter:
    """A binary file that keeps the crc32 and byte count of everything written through it (so
    the checksum is computed while writing, never by reading the file back), and the
    ``OSError`` a write raised (torch's zip writer replaces it by a ``RuntimeError``)."""

    def __init__(self, f) -> None:
        self._f = f
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data)
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def write_file(path: str, dump: Callable[[Any], None]) -> dict:
    """Create ``path`` with ``dump(file)`` (a binary file object), flush and fsync it; returns
    its record ``{"size": bytes, "crc32": checksum}``. A write the file system refuses raises
    ``OSError`` naming ``path`` with the file system's errno (ENOSPC for a full disk), also
    where ``dump`` (torch.save) turned it into another error."""
    w = None
    try:
        with open(path, "wb") as f:
            w = _CrcWriter(f)
            dump(w)
            f.flush()
            os.fsync(f.fileno())
    except Exception as exc:
        seen = w.error if w is not None and w.error is not None else exc
        if not isinstance(seen, OSError) or (seen is exc and exc.filename is not None):
            raise
        raise OSError(seen.errno, seen.strerror or str(seen), path) from exc
    return {"size": w.size, "crc32": w.crc}


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` (files created, renamed) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # a platform without directory descriptors: nothing more can be done
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network file systems refuse fsync on directories; their renames are sync
    finally:
        os.close(fd)


# -- verifying ------------------------------------------------------------------------------------
def _stat_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the manifest lists it): damaged "
                              f"checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from exc


def _check_size(path: str, record: dict, size: int) -> None:
    check(size == record["size"], path,
          f"{size} bytes, the manifest records {record['size']} (truncated or extended file)")


def _check_crc(path: str, record: dict, crc: int) -> None:
    check(crc == record["crc32"], path,
          f"crc32 {crc:08x}, the manifest records {record['crc32']:08x} (corrupt file)")


def check_size(path: str, record: dict) -> None:
    """Check that ``path`` exists and has the manifest's size (one ``stat``, nothing read)."""
    _check_size(path, record, _stat_size(path))


def verify_file(path: str, record: dict) -> None:
    """Check ``path``'s size (before reading it), then its crc32 (streamed), against the
    manifest's ``record``."""
    check_size(path, record)
    crc = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from exc
    _check_crc(path, record, crc)


def read_verified(path: str, record: dict | None) -> bytes:
    """The bytes of a small file, checked against ``record`` (None: unverified, format 1)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: damaged or incomplete checkpoint") from None
    except OSError as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from exc
    if record is not None:
        _check_size(path, record, len(data))
        _check_crc(path, record, zlib.crc32(data))
    return data


def parse_json(path: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}): damaged checkpoint") from None


# -- the manifest ---------------------------------------------------------------------------------
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def canonical_crc(obj: Any) -> int:
    """The crc32 of ``obj``'s canonical JSON form (sorted keys, no spaces): equal on every rank
    for equal data."""
    return zlib.crc32(_canonical(obj))


def encode_manifest(body: dict) -> bytes:
    """The manifest's bytes: ``body`` (normalised through JSON) plus ``"crc32"``, the checksum
    of the body's canonical form, written in canonical form itself (one line, sorted keys)."""
    body = json.loads(_canonical(body))  # tuples -> lists, int keys -> str: as a load sees it
    return _canonical({**body, "crc32": zlib.crc32(_canonical(body))})


def write_manifest(path_dir: str, body: dict, tag: str) -> None:
    """Commit: write the manifest to a temporary file, fsync it, rename it over
    ``manifest.json`` (atomic) and fsync the folder."""
    data = encode_manifest(body)
    tmp = os.path.join(path_dir, f"{MANIFEST}.tmp-{tag}")
    try:
        write_file(tmp, lambda f: f.write(data))
        os.replace(tmp, os.path.join(path_dir, MANIFEST))
    except Exception:
        _remove(tmp)
        raise
    fsync_dir(path_dir)


def read_manifest_bytes(path_dir: str) -> bytes:
    """The bytes of ``path_dir``'s manifest, unchecked (`parse_manifest` checks them)."""
    path = os.path.join(path_dir, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"no complete checkpoint in {path_dir!r} ({MANIFEST} is missing: "
                              f"no save finished there, or this is not a checkpoint directory)")
    return read_verified(path, None)


def parse_manifest(path_dir: str, data: bytes) -> dict:
    """The manifest of ``path_dir`` from its bytes ``data``, its checksum and schema verified."""
    path = os.path.join(path_dir, MANIFEST)
    m = parse_json(path, data)
    check(isinstance(m, dict), path, f"holds a {type(m).__name__}, not an object")
    if "crc32" in m or m.get("format") != 1:  # format 1 manifests carry no checksum
        crc = m.pop("crc32", None)
        check(is_int(crc), path, f"no valid checksum field 'crc32' (got {crc!r})")
        check(zlib.crc32(_canonical(m)) == crc, path,
              f"its body does not match its checksum {crc:08x} (corrupt manifest)")
        check(_canonical({**m, "crc32": crc}) == data, path,
              "not in the form it was written in (altered manifest)")
    validate_manifest(path, m)
    return m


def read_manifest(path_dir: str) -> dict:
    """The manifest of ``path_dir``, read, its checksum and schema verified."""
    return parse_manifest(path_dir, read_manifest_bytes(path_dir))


# -- schema ---------------------------------------------------------------------------------------
def _is_ranks(v: Any) -> bool:
    return is_int(v) or (isinstance(v, list) and len(v) > 0 and all(_is_ranks(x) for x in v))


def dtype_of(where: str, name: Any) -> torch.dtype:
    """The torch dtype named ``name`` ("float32"); `CheckpointError` at ``where`` if none."""
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    check(isinstance(dt, torch.dtype), where, f"unknown dtype {name!r}")
    return dt


def validate_tensor(where: str, d: Any) -> None:
    """A tensor description: shape, dtype, placement (device type, ranks), sbp strings."""
    check(isinstance(d, dict), where, f"a tensor description must be an object, got {d!r}")
    shape, pl, sbp = d.get("shape"), d.get("placement"), d.get("sbp")
    check(isinstance(shape, list) and all(is_int(n) and n >= 0 for n in shape), where,
          f"bad shape {shape!r}")
    dtype_of(where, d.get("dtype"))
    check(isinstance(pl, dict) and isinstance(pl.get("device_type"), str)
          and _is_ranks(pl.get("ranks")), where, f"bad placement {pl!r}")
    check(isinstance(sbp, list) and all(isinstance(s, str) for s in sbp), where,
          f"bad sbp {sbp!r}")


def _validate_files(path: str, files: Any, world: int) -> None:
    want = {"common.pt"} | {f"rank{r}.{e}" for r in range(world) for e in ("pt", "json")}
    check(isinstance(files, dict) and set(files) == want, path,
          f"'files' must list exactly {sorted(want)}, got "
          f"{sorted(files) if isinstance(files, dict) else files!r}")
    for name, rec in files.items():
        check(isinstance(rec, dict) and is_int(rec.get("size")) and rec["size"] >= 0
              and is_int(rec.get("crc32")) and 0 <= rec["crc32"] < 2 ** 32, path,
              f"bad record of {name}: {rec!r}")


def validate_manifest(path: str, m: dict) -> None:
    """The manifest's fields and their types (raise `CheckpointError` naming the first bad one)."""
    fmt = m.get("format")
    check(fmt in (1, FORMAT) and is_int(fmt), path,
          f"unknown checkpoint format {fmt!r} (this sbpflow reads 1 and {FORMAT})")
    for k, least in (("save_id", 0), ("world_size", 1)):
        check(is_int(m.get(k)) and m[k] >= least, path, f"bad {k} {m.get(k)!r}")
    step = m.get("step")  # an int; format 1 took any number
    check(step is None or is_int(step) or (fmt == 1 and isinstance(step, float)), path,
          f"bad step {step!r}")
    tensors = m.get("tensors")
    check(isinstance(tensors, dict), path, f"'tensors' must be an object, got {tensors!r}")
    for key, d in tensors.items():
        validate_tensor(f"{path}: tensor {key!r}", d)
    if fmt == 1:
        return
    check(m.get("generation") == generation_name(m["save_id"]), path,
          f"generation {m.get('generation')!r} does not belong to save "
          f"{generation_name(m['save_id'])!r}")
    _validate_files(path, m.get("files"), m["world_size"])
    previous = m.get("previous")  # absent from the first format-2 manifests
    check(previous is None or previous == "" or (isinstance(previous, str) and _GEN.fullmatch(
        previous) is not None and previous != m["generation"]), path,
        f"bad previous generation {previous!r}")


# -- generations ----------------------------------------------------------------------------------
def referenced_generation(path_dir: str) -> str | None:
    """The generation the folder's manifest commits to ("" for a format-1 checkpoint, None if
    there is no readable manifest)."""
    try:
        m = read_manifest(path_dir)
    except CheckpointError:
        return None
    return m.get("generation", "")


def clean(path_dir: str, keep: set, legacy: bool) -> None:
    """Remove generation directories not in ``keep``, temporary manifests and format-1
    temporary files; with ``legacy`` also format-1 checkpoint files. Best effort (a file that
    cannot be removed now is removed by a later save)."""
    try:
        names = os.listdir(path_dir)
    except OSError:
        return
    for name in names:
        path = os.path.join(path_dir, name)
        if _GEN.fullmatch(name) and name not in keep:
            shutil.rmtree(path, ignore_errors=True)
        elif _TEMP.fullmatch(name) or (legacy and _LEGACY.fullmatch(name)):
            _remove(path)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # best effort: a later save's clean-up removes it


def prune(path_dir: str) -> None:
    """Before a save writes, under the writer lock: remove the generations the manifest does
    not name (as the checkpoint or the one it replaced) and temporary manifests, the leftovers
    of killed or failed saves (no live writer has one in progress: each writes only under the
    lock). With no manifest, every generation is a leftover; with an unreadable one nothing is
    removed (it may yet be repaired)."""
    if os.path.exists(os.path.join(path_dir, MANIFEST)):
        try:
            m = read_manifest(path_dir)
        except CheckpointError:
            return
        keep = {m.get("generation", ""), m.get("previous") or ""}
    else:
        keep = set()
    clean(path_dir, keep, legacy=False)


def discard(path_dir: str, gen: str) -> None:
    """A failed save's own generation ``gen``: removed, unless the manifest names it (the
    commit's rename happened before the failure)."""
    if referenced_generation(path_dir) != gen:
        shutil.rmtree(os.path.join(path_dir, gen), ignore_errors=True)


def out_of_space(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` of a full disk or exceeded quota (ENOSPC, EDQUOT) that ``exc`` is or
    was caused by, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still write on ``path``'s file system (``os.statvfs``;
    -1 if it cannot tell)."""
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return -1
    return st.f_bavail * st.f_frsize


# -- the writer lock ------------------------------------------------------------------------------
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class WriterLock:
    """The writer lock of checkpoint folder ``path_dir``: an exclusive ``fcntl.flock`` on its
    ``writer.lock``, which names the holder (host, pid, since when). Rank 0 of a save holds it
    from before any file is written until after the clean-up; the other ranks of that save
    never take it. A writer that waits holds ``writer.wait`` meanwhile, which the holder's next
    save must pass: waiting writers are served in turn, none starves. Both files stay (a
    removed lock file would let two writers lock two files). Not thread-safe: one per save."""

    def __init__(self, path_dir: str) -> None:
        self.dir = path_dir
        self.path = os.path.join(path_dir, LOCK)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, timeout: float, what: str) -> bool:
        """Wait up to ``timeout`` seconds for the lock, then write this writer's name in it;
        True once held. False (and a warning) where the file system cannot lock: saves there
        are not serialised. `CheckpointError` naming the holder when the time runs out."""
        os.makedirs(self.dir, exist_ok=True)
        deadline = time.monotonic() + timeout
        queue = self._open(os.path.join(self.dir, _QUEUE))
        try:
            if not self._lock(queue, deadline, timeout, what):
                return False
            fd = self._open(self.path)
            try:
                if not self._lock(fd, deadline, timeout, what):
                    os.close(fd)
                    return False
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(queue)  # releases writer.wait: the next waiter may queue
        self._fd = fd
        self._sign()
        return True

    def release(self) -> None:
        """Unlock (and blank the holder's name); nothing if not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass  # the name stays: the next holder overwrites it
        os.close(fd)  # releases the flock

    @staticmethod
    def _open(path: str) -> int:
        return os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)

    def _lock(self, fd: int, deadline: float, timeout: float, what: str) -> bool:
        """Poll ``flock(fd)`` until ``deadline``; False where flock is not supported."""
        pause = 0.001
        while True:
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl module on this platform")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                warnings.warn(f"{what}: the file system cannot lock {self.path} ({exc}); saves "
                              f"from several jobs to this folder are not serialised and may "
                              f"remove each other's checkpoints", RuntimeWarning, stacklevel=4)
                return False
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(self._timeout_message(timeout, what))
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.02)

    def _sign(self) -> None:
        """Write who holds the lock (best effort: a full disk may refuse even that)."""
        me = json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                         "since": time.time()}).encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, me, 0)
        except OSError:
            pass

    def holder(self) -> str:
        """Who holds the lock, as its file says: ``"pid P on host 'H' (saving for S s)"``."""
        try:
            with open(self.path, "rb") as f:
                h = json.loads(f.read().decode("utf-8"))
            since = f" (saving for {max(time.time() - float(h['since']), 0.0):.1f} s)"
            return f"pid {int(h['pid'])} on host {str(h['host'])!r}{since}"
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return "a writer whose name the lock file does not hold (it is just starting)"

    def _timeout_message(self, timeout: float, what: str) -> str:
        return (f"{what}: another writer is saving to this folder: {self.holder()} holds its "
                f"lock {self.path} and did not finish within {timeout:g} s. Two jobs save to "
                f"one folder (a restarted job overlapping the old one?): stop the other one "
                f"or save to another folder, or wait longer (sf.save(..., lock_timeout="
                f"seconds) or SBPFLOW_CHECKPOINT_LOCK_TIMEOUT). Nothing was written; the "
                f"checkpoint there is unchanged")


def _is_box(box: Any, shape: list) -> bool:
    return isinstance(box, list) and len(box) == len(shape) and all(
        isinstance(b, list) and len(b) == 2 and is_int(b[0]) and is_int(b[1])
        and b[0] >= 0 and b[1] >= 0 and b[0] + b[1] <= n for b, n in zip(box, shape))


def _check_save(path: str, record: Any, save_id: int, kind: str) -> None:
    """A file's record is ``kind`` (a dict) and belongs to save ``save_id``."""
    check(isinstance(record, dict), path, f"holds a {type(record).__name__}, not {kind}")
    check(record.get("save_id") == save_id, path,
          f"belongs to another save ({record.get('save_id')!r}) than {MANIFEST} ({save_id}): "
          f"mixed checkpoint")


def validate_rank_index(path: str, meta: Any, rank: int, save_id: int, tensors: dict) -> None:
    """A rank's index (``rank{r}.json``): its save, its rank, and for each shard a tensor
    description that agrees with the manifest, the region it holds and its reduction."""
    _check_save(path, meta, save_id, "an object")
    check(meta.get("rank") == rank, path, f"is the index of rank {meta.get('rank')!r}")
    entries = meta.get("entries")
    check(isinstance(entries, dict), path, f"'entries' must be an object, got {entries!r}")
    for key, e in entries.items():
        where = f"{path}: entry {key!r}"
        validate_tensor(where, e)
        d = tensors.get(key)
        check(d is not None, where, f"not a tensor of {MANIFEST}")
        check(e["shape"] == d["shape"] and e["dtype"] == d["dtype"], where,
              f"shape {e['shape']} {e['dtype']}, the manifest's {d['shape']} {d['dtype']}")
        check(_is_box(e.get("box"), e["shape"]), where,
              f"bad region {e.get('box')!r} of a tensor of shape {e['shape']}")
        check(e.get("partial") in (None, "sum", "max", "min"), where,
              f"bad reduction {e.get('partial')!r}")


def validate_common(path: str, c: Any, save_id: int) -> None:
    """``common.pt``: its save, the seed stream, the optimizer's class, groups and scalars."""
    _check_save(path, c, save_id, "a dict")
    rng = c.get("rng")
    check(isinstance(rng, (list, tuple)) and len(rng) == 2 and all(is_int(v) for v in rng),
          path, f"bad random state {rng!r}")
    optim = c.get("optim")
    if optim is None:
        return
    groups, scalars = (optim.get("param_groups"), optim.get("scalars")) \
        if isinstance(optim, dict) else (None, None)
    check(isinstance(optim, dict) and isinstance(optim.get("class"), str), path,
          "bad optimizer record (no class name)")
    check(isinstance(groups, list) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list)
        and all(isinstance(n, str) for n in g["params"]) for g in groups), path,
        "bad optimizer parameter groups")
    check(isinstance(scalars, dict) and all(isinstance(v, dict) for v in scalars.values()),
          path, "bad optimizer scalar state")


def validate_shards(path: str, data: Any, rank: int, save_id: int, entries: dict) -> None:
    """``rank{r}.pt``: its save and rank, and exactly the shards its index lists, each of the
    index's region shape and dtype."""
    _check_save(path, data, save_id, "a dict")
    check(data.get("rank") == rank, path, f"holds the shards of rank {data.get('rank')!r}")
    tensors = data.get("tensors")
    check(isinstance(tensors, dict) and set(tensors) == set(entries), path,
          f"its shards {sorted(tensors) if isinstance(tensors, dict) else tensors!r} are not "
          f"those of its index {sorted(entries)}")
    for key, t in tensors.items():
        e = entries[key]
        want = [n for _, n in e["box"]]
        check(isinstance(t, torch.Tensor) and list(t.shape) == want
              and str(t.dtype) == f"torch.{e['dtype']}", path,
              f"shard {key!r} is not a {e['dtype']} tensor of shape {want}")
