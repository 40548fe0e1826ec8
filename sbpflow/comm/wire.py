"""The wire format of message channels between rank processes: typed frames, no code from the wire.

A frame: a prefix ``"!QIiHH"`` (bytes after it, body bytes, source rank, channel bytes, buffer
count), a ``"!Q"`` size per buffer, the channel (utf-8), the body, then each tensor's bytes as
they are in memory (out of band), or (`IN_RING` set in the count) the ``"!Q"`` position in the
sender's shared-memory ring (`shm_ring`) where they lie, before the channel. The body is a
fixed-size binary record (`records`: a ``req`` / ``ack``, `RECORD` set in the count) or the
message's structure (pickle protocol 5, restricted): ``None``, bools, numbers, strings, bytes,
tuples, lists, dicts, sets, torch dtypes, ``torch.Size`` / ``torch.device`` and tensors.
`decode` resolves no other global — a frame that names one (a class whose ``__reduce__`` would
run code) is a `WireError` and nothing in it is called; `encode` refuses any other object at
the sender (`WireError` naming the type). See docs/runtime.md, 'What the transport trusts'.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import threading
from typing import Any

import numpy
import torch

from ..errors import WireError
from . import records

__all__ = ["PREFIX", "IN_RING", "RECORD", "encode", "encode_body", "encode_any", "ring_frame",
           "decode", "FrameReader", "parse_frame", "copied"]

PREFIX = struct.Struct("!QIiHH")  # after-prefix bytes, body bytes, src, channel bytes, buffers
IN_RING = 1 << 15  # in a frame's buffer count: the buffers lie in the sender's ring
RECORD = 1 << 14  # in a frame's buffer count: the body is a binary record (`records`)
_COUNT = RECORD - 1  # the buffer count's own bits
_SIZE = struct.Struct("!Q")

# the globals a body may name; nothing else is resolved (torch.load(weights_only=True)'s idea)
_TORCH_TYPES = {"Size": torch.Size, "device": torch.device}
_BUILTINS = {"complex": complex, "slice": slice, "range": range, "bytearray": bytearray}
_PLAIN = (torch.dtype, torch.Size, torch.device, complex, slice, range, bytearray)
_ATOMS = {int, float, bool, str, bytes, pickle.PickleBuffer}  # types the pickler writes itself


def _tensor(data: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool,
            device: str) -> torch.Tensor:
    """A tensor of ``shape`` / ``dtype`` on ``device`` from its raw bytes (a storage of its
    own): the only function a frame can call, and it checks its arguments first."""
    if not (isinstance(dtype, torch.dtype) and isinstance(shape, tuple)
            and all(type(n) is int and n >= 0 for n in shape)
            and type(requires_grad) is bool and isinstance(device, str)):
        raise WireError("a tensor record of the wrong form")
    data = memoryview(data).cast("B")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise WireError(f"a tensor of shape {shape} and {dtype} with {len(data)} bytes")
    out = torch.empty(shape, dtype=dtype)
    if len(data):  # (numpy copies from a read-only buffer; torch.frombuffer would warn)
        out.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(data, numpy.uint8)
    if device != "cpu":
        out = out.to(device)
    return out.requires_grad_() if requires_grad else out


# what the plain types and tensors reduce to (ids: `in` on a tuple would compare with ==)
_CALLABLES = {id(c) for c in (_tensor, torch.Size, torch.device, complex, slice, range,
                              bytearray)}


class _Pickler(pickle.Pickler):
    """A tensor as its raw bytes (out of band), dtype, shape, flag and device: torch's own
    pickling goes through ``torch.save`` of its storage, some 100 us a message each way where
    this takes about 20, and needs torch's rebuild functions on the other side. Any other
    object that is not plain data is refused here, at the sender."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return _reduce_tensor(obj)
        if isinstance(obj, _PLAIN) or type(obj) in _ATOMS or id(obj) in _CALLABLES:
            return NotImplemented
        raise WireError(f"a message channel carries plain data and tensors only, not "
                        f"{type(obj).__module__}.{type(obj).__qualname__} ({obj!r:.80}); send "
                        f"its fields (numbers, strings, tuples, dicts, tensors) instead")


def _reduce_tensor(t: torch.Tensor) -> tuple:
    if t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise WireError(f"a message channel carries strided tensors only, not a {t.layout} "
                        f"one of shape {tuple(t.shape)}")
    flat = t.detach() if t.requires_grad else t
    if flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg()
    device = "cpu" if flat.is_cpu else str(flat.device)
    if device != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return _tensor, (pickle.PickleBuffer(flat.view(-1).view(torch.uint8).numpy()), t.dtype,
                     tuple(t.shape), t.requires_grad, device)


class _Unpickler(pickle.Unpickler):
    """Resolves only `_tensor`, torch's dtypes, ``torch.Size``, ``torch.device`` and a few
    builtins; every other global (the way a pickle runs code) is a `WireError`."""

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name == "_tensor":
            return _tensor
        if module == "torch":
            found = _TORCH_TYPES.get(name) or getattr(torch, name, None)
            if isinstance(found, torch.dtype) or found in _TORCH_TYPES.values():
                return found
        if module == "builtins" and name in _BUILTINS:
            return _BUILTINS[name]
        raise WireError(f"a frame names {module}.{name}, which a message never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise WireError("a frame with a persistent id")


class _Encoder(threading.local):
    """A thread's pickler, kept from message to message (making one costs more than a small
    message's whole encoding)."""

    def __init__(self) -> None:
        self.out = io.BytesIO()
        self.buffers: list[pickle.PickleBuffer] = []
        self.pickler = _Pickler(self.out, protocol=5, buffer_callback=self.buffers.append)

    def dump(self, message: Any) -> tuple[bytes, list]:
        out, buffers = self.out, self.buffers
        out.seek(0)
        out.truncate()
        buffers.clear()
        self.pickler.clear_memo()
        self.pickler.dump(message)
        return out.getvalue(), [b.raw() for b in buffers]


_ENCODER = _Encoder()


def encode_body(message: Any) -> tuple[bytes, list]:
    """``(body, buffers)`` of ``message``: its structure and its tensors' bytes (views of their
    memory, valid while the tensors are). `WireError` for an object that is not plain data."""
    body, views = _ENCODER.dump(message)
    if len(views) > _COUNT:
        raise WireError(f"a message of {len(views)} tensors: send at most {_COUNT} in one")
    return body, views


def encode_any(message: Any) -> tuple[bytes, list, int]:
    """``(body, buffers, flag)``: a record's (`records`; ``flag`` `RECORD`, its value's
    tensors the buffers) when ``message`` is one, else `encode_body`'s with flag 0."""
    rec = records.pack(message)
    if rec is None:
        return (*encode_body(message), 0)
    head, kind, value = rec
    if kind != records.PICKLED:
        return head, [], RECORD
    body, views = encode_body(value)
    return head + body, views, RECORD


def ring_frame(src: int, channel: str, body: bytes, views: list, pos: int,
               flag: int = 0) -> bytes:
    """The frame of a message whose buffers ``views`` lie in the sender's ring at ``pos``
    (``flag``: `encode_any`'s)."""
    name = channel.encode()
    sizes = b"".join(_SIZE.pack(v.nbytes) for v in views)
    after = len(sizes) + _SIZE.size + len(name) + len(body)
    return (PREFIX.pack(after, len(body), src, len(name), len(views) | IN_RING | flag) + sizes
            + _SIZE.pack(pos) + name + body)


def encode(src: int, channel: str, message: Any, body: tuple | None = None) -> list:
    """The parts of ``message``'s frame, to be written in order: one bytes object for a message
    without tensors; else the tensors' bytes follow, as views of their memory. `WireError` for
    an object that is not plain data (named). ``body``: `encode_any`'s, if made already."""
    body, views, flag = encode_any(message) if body is None else body
    name = channel.encode()
    if not views:
        n = len(name) + len(body)
        return [PREFIX.pack(n, len(body), src, len(name), flag) + name + body]
    sizes = b"".join(_SIZE.pack(v.nbytes) for v in views)
    after = len(sizes) + len(name) + len(body) + sum(v.nbytes for v in views)
    return [PREFIX.pack(after, len(body), src, len(name), len(views) | flag) + sizes + name
            + body, *views]


def _decode(data: Any, buffers: list, record: int) -> Any:
    """The message of the body ``data``: a record's (``record`` set) or `decode`'s."""
    if not record:
        return decode(data, buffers)
    head, kind = records.unpack(data, 0, len(data))
    if kind != records.PICKLED:
        if buffers:
            raise WireError("a record without a value, with tensor buffers")
        return head
    return head + (decode(data[records.HEAD.size:], buffers),)


def decode(body: Any, buffers: list) -> Any:
    """The message of a frame's ``body`` and ``buffers`` (`WireError` if it does not parse)."""
    try:
        return _Unpickler(io.BytesIO(body), buffers=buffers).load()
    except WireError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformed body
        raise WireError(f"a body that does not parse ({type(exc).__name__}: {exc})") from None


def _split(view: memoryview, after: int, body_n: int, chan_n: int, n_buf: int) -> tuple:
    """``(channel, body, buffers)`` of the bytes after a prefix, their sizes checked."""
    if after < n_buf * _SIZE.size + chan_n + body_n:
        raise WireError("a frame whose sizes do not add up")
    at = n_buf * _SIZE.size
    sizes = [_SIZE.unpack_from(view, i * _SIZE.size)[0] for i in range(n_buf)]
    if at + chan_n + body_n + sum(sizes) != after:
        raise WireError("a frame whose sizes do not add up")
    channel = _channel(view[at:at + chan_n])
    at += chan_n
    body = view[at:at + body_n]
    at += body_n
    buffers = []
    for n in sizes:
        buffers.append(view[at:at + n])
        at += n
    return channel, body, buffers


def parse_frame(data: bytes) -> tuple[int, str, Any]:
    """``(src, channel, message)`` of one whole frame (`WireError` if it is not one)."""
    reader = FrameReader()
    frames = reader.feed(data)
    if reader.error is not None:
        raise reader.error
    if len(frames) != 1 or reader.buf:
        raise WireError(f"{len(data)} bytes that are not one whole frame")
    return frames[0]


def copied(src: int, channel: str, message: Any) -> Any:
    """``message`` as its receiver gets it: encoded and decoded (a post to oneself)."""
    return parse_frame(b"".join(encode(src, channel, message)))[2]


def _channel(raw) -> str:
    try:
        return bytes(raw).decode()
    except UnicodeDecodeError:
        raise WireError("a frame whose channel name is not utf-8") from None


class FrameReader:
    """Cuts a connection's byte stream into frames: ``feed(data)`` returns ``(src, channel,
    message)`` of each frame completed. At a malformed frame it stops and keeps the
    `WireError` in ``error``: the frames before it are returned, nothing after it is read (the
    caller drops the connection: nothing after it can be trusted to be in step)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.error: WireError | None = None
        self.ring: Any = None  # the sender's `shm_ring.Ring`, once the connection has one

    def feed(self, data: bytes) -> list[tuple[int, str, Any]]:
        if self.error is not None:
            return []
        buf = self.buf
        buf += data
        start, out, end = 0, [], len(buf)
        try:
            while end - start >= PREFIX.size:
                after, body_n, src, chan_n, n_buf = PREFIX.unpack_from(buf, start)
                lo = start + PREFIX.size
                if end - lo < after:
                    break
                if n_buf == RECORD and chan_n + body_n == after:  # a req / ack: the common case
                    channel = _channel(buf[lo:lo + chan_n])
                    message, kind = records.unpack(buf, lo + chan_n, body_n)
                    if kind == records.PICKLED:
                        message += (decode(bytes(buf[lo + chan_n + records.HEAD.size:
                                                     lo + after]), []),)
                elif n_buf == 0 and chan_n + body_n == after:  # no tensors
                    channel = _channel(buf[lo:lo + chan_n])
                    message = decode(bytes(buf[lo + chan_n:lo + after]), [])
                elif n_buf & IN_RING:
                    channel, message = self._from_ring(lo, after, body_n, chan_n,
                                                       n_buf & _COUNT, n_buf & RECORD)
                else:
                    channel, message = self._with_buffers(lo, after, body_n, chan_n,
                                                          n_buf & _COUNT, n_buf & RECORD)
                out.append((src, channel, message))
                start = lo + after
        except WireError as exc:
            self.error = exc
        finally:
            if start:
                del buf[:start]
        return out

    def _from_ring(self, lo: int, after: int, body_n: int, chan_n: int,
                   n_buf: int, record: int) -> tuple[str, Any]:
        """A frame whose buffers lie in the sender's ring: read, decoded (copied out), freed."""
        if self.ring is None:
            raise WireError("a frame naming a shared-memory ring, on a connection with none")
        at = lo + n_buf * _SIZE.size
        if after != n_buf * _SIZE.size + _SIZE.size + chan_n + body_n:
            raise WireError("a frame whose sizes do not add up")
        sizes = [_SIZE.unpack_from(self.buf, lo + i * _SIZE.size)[0] for i in range(n_buf)]
        (pos,) = _SIZE.unpack_from(self.buf, at)
        at += _SIZE.size
        channel = _channel(self.buf[at:at + chan_n])
        body = bytes(self.buf[at + chan_n:at + chan_n + body_n])
        buffers = self.ring.read(pos, sizes)
        try:
            return channel, _decode(body, buffers, record)
        finally:  # (decoding copied the bytes out)
            [b.release() for b in buffers]
            self.ring.free()

    def _with_buffers(self, lo: int, after: int, body_n: int, chan_n: int,
                      n_buf: int, record: int) -> tuple[str, Any]:
        with memoryview(self.buf) as whole, whole[lo:lo + after] as frame:
            channel, body, buffers = _split(frame, after, body_n, chan_n, n_buf)
            try:
                return channel, _decode(body, buffers, record)
            finally:  # released before buf resizes
                body.release()
                [b.release() for b in buffers]
