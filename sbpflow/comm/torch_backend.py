"""torch.distributed backend: one process a rank, gloo on CPU (NCCL for cuda tensors).

See docs/internals.md, 'The torch.distributed backend'.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import threading
import weakref
from collections import deque
from functools import partial
from typing import Any, Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ..errors import CommError, CommTimeout
from .base import Communicator, Pending, collective_stream, nbytes, reduce_tensors
from .channels import tensor_bytes
from .socket_channels import SocketChannels
from .ring_p2p import RingP2P
from .shm_collectives import SHM_MIN, ShmGroup, segment_bytes
from .current import current_process, set_current
from .progress import P2P, Progress, group_key, period_for
from .base import default_timeout

__all__ = ["TorchCommunicator", "init_from_env", "shutdown"]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_CPU = torch.device("cpu")  # (made once: a transfer asks for it on every message)
# a gloo connection gone: a peer exited, or either end's call timed out and closed the pair
_CLOSED = re.compile(r"closed|reset by peer|broken pipe", re.IGNORECASE)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat contiguous uint8 tensor (a view when ``t`` is contiguous). Two tensor
    calls in the usual case (a detached contiguous tensor): this is on every message's path."""
    if t.requires_grad:
        t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(-1).view(torch.uint8)


def _typed(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return buf.view(dtype).reshape(tuple(shape))


class _Received(NamedTuple):
    """What a collective received: ``pieces``, uint8 views in group order, and ``flat``, the
    one buffer they fill back to back in that order (None when the group is not in rank
    order, the order the buffer holds them in)."""

    pieces: list
    flat: torch.Tensor | None


class _Scratch(threading.local):
    """A thread's reusable wire buffers, for bytes that live only inside one collective (what
    is packed to send; what is received, then copied out or reduced). A new buffer's pages
    fault in on first touch, which on a loaded host costs as much as the copy into it."""

    LIMIT = 64 << 20  # bytes; larger buffers are made for the call and not kept

    def __init__(self) -> None:
        self.bufs: dict[tuple, torch.Tensor] = {}

    def get(self, slot: str, n: int, device: torch.device) -> torch.Tensor:
        """``n`` bytes (uint8) of this thread's buffer ``slot`` on ``device``: its contents
        are overwritten by the next call with the same slot on this thread."""
        if n > self.LIMIT:
            return torch.empty(n, dtype=torch.uint8, device=device)
        buf = self.bufs.get((slot, device))
        if buf is None or buf.numel() < n:
            buf = self.bufs[(slot, device)] = torch.empty(n, dtype=torch.uint8, device=device)
        return buf[:n]


_SCRATCH = _Scratch()


def _receive_buffer(n: int, wire: torch.device, keep: bool) -> torch.Tensor:
    """``n`` bytes to receive into: new when the caller keeps them, else this thread's
    scratch."""
    if keep:
        return torch.empty(n, dtype=torch.uint8, device=wire)
    return _SCRATCH.get("recv", n, wire)


def _pack(pieces: list[torch.Tensor], wire: torch.device, into=None) -> torch.Tensor:
    """``pieces`` (one dtype, any strides) back to back as one flat uint8 tensor on ``wire``:
    a view of their own buffer when they already lie so in it (the pieces of a batch split,
    on the wire's device), else one copy of each into ``into(nbytes)`` (default: a new
    buffer)."""
    sizes = [nbytes(p) for p in pieces]
    full = [(p, n) for p, n in zip(pieces, sizes) if n]
    if not full:
        return torch.empty(0, dtype=torch.uint8, device=wire)
    first = full[0][0]
    if first.device == wire and all(p.is_contiguous() for p, _ in full):
        ptr, storage = first.data_ptr(), first.untyped_storage().data_ptr()
        adjacent = True
        for p, n in full:
            adjacent = adjacent and p.data_ptr() == ptr and \
                p.untyped_storage().data_ptr() == storage
            ptr += n
        if adjacent:
            b = _bytes(first)
            return b.as_strided((sum(sizes),), (1,), b.storage_offset())
    out = (into or (lambda n: torch.empty(n, dtype=torch.uint8, device=wire)))(sum(sizes))
    at = 0
    for p, n in zip(pieces, sizes):
        if n:
            out[at:at + n].view(p.dtype).view(p.shape).copy_(p.detach())
        at += n
    return out


class TorchCommunicator(Communicator):
    """This process's rank of the default torch.distributed process group.

    Make one per default group (`init_from_env` does): subgroups are rendezvoused under fixed
    store keys, so a second communicator on the same world must not create them again.
    """

    backend = "torch"

    def __init__(self, timeout: float | None = None) -> None:
        if not dist.is_initialized():
            raise CommError("TorchCommunicator needs torch.distributed to be initialized; "
                            "use sbpflow.init() or sbpflow.launch(..., backend='torch')")
        super().__init__(dist.get_rank(), dist.get_world_size())
        self.timeout = datetime.timedelta(seconds=timeout or default_timeout())
        self.world_pg = dist.group.WORLD
        self.nccl = "nccl" in str(dist.get_backend()).lower()
        self._groups: dict[tuple, Any] = {}  # never re-created: their store keys stay
        self._shm: dict[tuple, ShmGroup | None] = {}  # as _groups; None: gloo only
        self._shm_bytes = segment_bytes()
        self._loopback: deque[torch.Tensor] = deque()  # messages this rank sent to itself
        # which collective each rank reached, so that a timeout names the ranks it waited for
        self.progress = Progress(self.rank, c10d._get_default_store(),
                                 period_for(self.timeout.total_seconds()), self.activity)
        self._keys: dict[tuple, str] = {}  # (group, cuda) -> its progress key
        # post / inbox: made now, so that a peer's first post finds this rank's address
        self._channels: SocketChannels | None = None
        self._channels_lock = threading.Lock()  # the runtime posts and reads from threads
        self._chan()
        # same-host send / recv through the channels and their rings (`_ringed`)
        self._p2p = RingP2P(self.rank, self._chan, self.timeout.total_seconds())

    def wait_timeout(self) -> float:
        return self.timeout.total_seconds()   # (the process groups' own)

    def whereabouts(self, ranks, threshold):
        return self.progress.inquire(sorted(ranks), threshold=threshold)

    def _key(self, group: tuple, cuda: bool) -> str:
        """``group_key(group, cuda)`` (and the collective stream), cached (this is on every
        collective's path)."""
        stream = collective_stream()
        key = self._keys.get((group, cuda, stream))
        if key is None:
            key = group_key(group, cuda) + ("" if stream is None else f"/{stream}")
            self._keys[(group, cuda, stream)] = key
        return key

    # -- process groups and devices --------------------------------------------------------
    def _pg(self, group: tuple, cuda: bool):
        """The process group of ``group``'s members (ranks sorted), created on first use."""
        ranks = tuple(sorted(group))
        stream = collective_stream()  # a stream has process groups of its own (its order)
        if stream is None and ranks == tuple(range(self.world_size)):
            return self.world_pg
        key = (ranks, cuda, stream)
        pg = self._groups.get(key)
        if pg is None:
            name = f"sbpflow/{'nccl' if cuda else 'gloo'}/{'_'.join(map(str, ranks))}/" + \
                ("" if stream is None else f"{stream}/")
            store = dist.PrefixStore(name, c10d._get_default_store())
            me = ranks.index(self.rank)
            what = "creating the process group"  # collective #1 of the group: a rendezvous
            seq = self.progress.enter(self._key(ranks, cuda), what, members=ranks)
            try:
                if cuda:
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self.timeout
                    pg = dist.ProcessGroupNCCL(store, me, len(ranks), opts)
                else:
                    pg = dist.ProcessGroupGloo(store, me, len(ranks), self.timeout)
            except RuntimeError as exc:
                raise self._error(what, group, exc, cuda, seq) from exc
            finally:
                self.progress.leave(self._key(ranks, cuda), seq)
            self._groups[key] = pg
        return pg

    def close(self) -> None:
        """Drop this communicator's process groups (its subgroups and its reference to the
        default group, which `shutdown` destroys), so they are torn down now, while the
        interpreter is alive. Call it when no collective is in flight: gloo waits for queued
        work (at most the collective timeout) before it lets a group go."""
        groups, self._groups = list(self._groups.values()), {}
        for shm in self._shm.values():
            if shm is not None:
                shm.close()
        self._shm = {}
        self.world_pg = None
        self.progress.close()
        if self._channels is not None:  # stop the channels' threads, close their sockets
            self._channels.close()
        for pg in groups:
            try:
                pg.shutdown()
            except RuntimeError:  # already broken (a peer died): nothing left to release
                pass

    def _wire(self, device: torch.device) -> tuple[torch.device, bool]:
        """Where tensors of ``device`` travel, and whether that is the NCCL backend."""
        if device.type == "cuda" and self.nccl:
            return device, True
        return torch.device("cpu"), False

    def _run(self, what: str, group: Sequence[int], cuda: bool | None,
             start: Callable[[], Any]) -> None:
        """Start a torch collective of ``group``'s process group on gloo or NCCL (``cuda``;
        None: point-to-point on the default group) and wait for it. ``start()`` returns its
        Work or a list of them."""
        key = P2P if cuda is None else self._key(tuple(group), cuda)
        seq = self.progress.enter(key, what, members=group)
        try:
            works = start()
            for w in works if isinstance(works, list) else [works]:
                w.wait()
        except RuntimeError as exc:  # DistBackendError, DistNetworkError, gloo errors
            raise self._error(what, group, exc, cuda, seq) from exc
        finally:
            self.progress.leave(key, seq)

    def _error(self, what: str, group: Sequence[int], exc: Exception, cuda: bool | None,
               seq: int) -> CommError:
        """A torch error as `CommError`, naming the call; a timeout as `CommTimeout`. A timeout
        or a closed connection (gloo closes a pair when either end's call times out, or a
        peer exits) says also what the members were doing, from their `Progress` records,
        and names as its ``culprits`` the members that had not reached collective ``seq`` of
        the group (``cuda`` as in `_run`), or, point-to-point, the ranks that wait for no
        other (`Progress.inquire`): a peer's timeout closing the connection names the rank
        that held the peer up too, not only the peer."""
        text = str(exc).split("\n")[0]
        secs = self.timeout.total_seconds()
        call = what if cuda is None else f"{what} over ranks {list(group)}"
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        if not timed_out and not _CLOSED.search(text):
            return CommError(f"{call} failed on rank {self.rank}: {text} (timeout {secs:g} s, "
                             f"SBPFLOW_TIMEOUT)")
        if cuda is None:  # point-to-point: no common numbering, say what the peers were doing
            found = self.progress.inquire(sorted(group), threshold=secs / 2)
        else:
            found = self.progress.inquire(sorted(group), self._key(tuple(group), cuda), seq)
        if timed_out:
            seq_text = "" if cuda is None else f" (collective #{seq} of that group)"
            err = CommTimeout(f"{call}{seq_text} timed out on rank {self.rank} after {secs:g} s: "
                              f"{found.text}. torch: {text}. If the ranks are only slow, raise "
                              f"the timeout (SBPFLOW_TIMEOUT=<seconds>, or launch(..., "
                              f"timeout=<seconds>))")
        else:
            err = CommError(f"{call} failed on rank {self.rank}: {text} (timeout {secs:g} s, "
                            f"SBPFLOW_TIMEOUT); the ranks: {found.text}")
        err.culprits = found.culprits
        return err

    def _chan(self) -> SocketChannels:
        made = self._channels
        if made is not None:  # (every post and lead asks: no lock once made)
            return made
        with self._channels_lock:
            if self._channels is None:  # SBPFLOW_CHANNELS=store: the c10d store's queues
                self._channels = SocketChannels(
                    self.rank, c10d._get_default_store(), self.timeout.total_seconds(),
                    force_store=os.environ.get("SBPFLOW_CHANNELS") == "store")
            return self._channels

    def _post(self, dst, channel, message):
        self._chan().post(self.rank, dst, channel, message)

    def _inbox(self, channel, timeout):
        return self._chan().take(self.rank, channel, timeout, lambda: None)

    def listen(self, channel, deliver, failed):
        me = weakref.ref(self)  # (the receiver thread keeps the listener: not the communicator)

        def counted(got: list) -> None:
            comm = me()
            if comm is not None:
                comm._count("message", 0, sum(tensor_bytes(m) for _, m in got))
            deliver(got)
        return self._chan().listen(channel, counted, failed)

    @property
    def leads(self) -> bool:
        return self._chan().leads

    def lead(self, timeout):
        return self._chan().lead(timeout)

    def wake_leader(self):
        self._chan().wake_leader()

    def lead_end(self):
        self._chan().lead_end()

    def device(self, device_type: str) -> torch.device:
        if device_type == "cpu":
            return _CPU
        if device_type == "cuda":
            n = torch.cuda.device_count()
            if n == 0:
                raise CommError(f"rank {self.rank}: a cuda placement but no cuda device")
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank % n)))
        raise CommError(f"unknown device type {device_type!r}; use 'cpu' or 'cuda'")

    # -- the byte all-to-all everything else is built on -----------------------------------
    def _a2a(self, send: list[torch.Tensor], recv_nbytes: list[int], group: tuple,
             device: torch.device, what: str, keep: bool = True) -> "_Received":
        """Send ``send[j]`` (a tensor of any strides; one dtype for all) to ``group[j]``;
        return the uint8 buffers received from each ``group[j]`` (views of one buffer on
        ``device``), in group order. ``keep``: the caller may keep that buffer (else it is
        this thread's scratch, valid until its next collective)."""
        wire, cuda = self._wire(device)
        perm = [group.index(r) for r in sorted(group)]  # pg rank k is group[perm[k]]
        inp = _pack([send[j] for j in perm], wire, partial(_SCRATCH.get, "send", device=wire))
        out_splits = [recv_nbytes[j] for j in perm]
        out = _receive_buffer(sum(out_splits), wire, keep)
        pg = self._pg(group, cuda)
        self._run(what, group, cuda, lambda: pg.alltoall_base(
            out, inp, out_splits, [nbytes(send[j]) for j in perm]))
        out = out.to(device)
        views = out.split(out_splits)
        result: list[torch.Tensor] = [views[0]] * len(group)
        for k, j in enumerate(perm):
            result[j] = views[k]
        return _Received(result, out if perm == sorted(perm) else None)

    # -- hooks -------------------------------------------------------------------------------
    def _all_gather(self, tensor, group, shapes, assemble, joined=None):
        """The backend's all-gather when every member's piece has one size; else each member
        sends its tensor to every other member (``alltoall_base``, which takes any sizes).
        ``joined``: the gathered buffer is the result when the group is in rank order."""
        sizes = [nbytes(s, tensor.dtype) for s in shapes]
        keep = joined is not None and list(group) == sorted(group)  # the buffer is the result
        if len(set(sizes)) == 1:
            got = self._gather_even(_bytes(tensor), group, tensor.device, keep)
        else:
            got = self._a2a([tensor] * len(group), sizes, group, tensor.device, "all_gather",
                            keep)
        if joined is not None and got.flat is not None:
            return _typed(got.flat, tensor.dtype, joined)
        return assemble([_typed(g, tensor.dtype, s) for g, s in zip(got.pieces, shapes)])

    def _gather_even(self, b: torch.Tensor, group: tuple, device: torch.device,
                     keep: bool = True) -> "_Received":
        """``all_gather_into_tensor`` of the flat uint8 ``b`` (one size on every member): the
        pieces in group order (views of one buffer on ``device``; ``keep`` as in `_a2a`)."""
        wire, cuda = self._wire(device)
        inp = b.to(wire)
        out = _receive_buffer(inp.numel() * len(group), wire, keep)
        pg = self._pg(group, cuda)
        shm = None if cuda else self._shared(group, inp.numel())
        if shm is not None:
            shm.all_gather(inp, range(len(group)), self._barrier_of("all_gather", group), out)
        else:
            self._run("all_gather", group, cuda,
                      lambda: pg._allgather_base(out, inp))  # a pg of our own: not in c10d's
        out = out.to(device)
        views = out.split(inp.numel())   # in pg rank order: sorted(group)
        order = sorted(group)
        in_order = order == list(group)
        return _Received(views if in_order else [views[order.index(r)] for r in group],
                         out if in_order else None)

    def _all_to_all(self, pieces, group, shapes, assemble, joined=None):
        """``pieces[j]`` goes to ``group[j]``; ``shapes[j]`` comes from ``group[j]``."""
        dtype = pieces[0].dtype
        keep = joined is not None and list(group) == sorted(group)
        got = self._a2a(pieces, [nbytes(s, dtype) for s in shapes], group,
                        pieces[0].device, "all_to_all", keep)
        if joined is not None and got.flat is not None:
            return _typed(got.flat, dtype, joined)
        return assemble([_typed(g, dtype, s) for g, s in zip(got.pieces, shapes)])

    def _reduce_scatter(self, pieces, group, op):
        """All-to-all of the pieces, then the ``op``-reduction in group order, locally."""
        mine = pieces[group.index(self.rank)]
        got = self._a2a(pieces, [nbytes(mine)] * len(group), group,
                        mine.device, f"reduce_scatter({op})", keep=False)
        return reduce_tensors([_typed(g, mine.dtype, mine.shape) for g in got.pieces], op)

    def _all_reduce(self, tensor, group, op):
        """The backend's all-reduce on a copy (the input is left unchanged)."""
        return self._all_reduce_start(tensor, group, op, now=True).wait()

    def _all_reduce_start(self, tensor, group, op, inplace=False, now=False) -> Pending:
        """Start the backend's all-reduce on a copy (``inplace``: on ``tensor`` itself when it
        is contiguous and on the wire's device); the returned `Pending` waits for it (gloo and
        NCCL progress it on their own threads / streams meanwhile). ``now``: the caller waits
        at once (a synchronous all-reduce).

        The progress record holds it open, as started and not waited for, until ``wait()``
        blocks in it, and then until it ends; a `Pending` dropped unwaited closes it then (the
        rank will never wait in it)."""
        wire, cuda = self._wire(tensor.device)
        shm = None if cuda else self._shared(group, nbytes(tensor))
        if shm is not None:   # done now: the shared-memory path has no thread of its own
            order = sorted(group)
            got = shm.all_reduce(tensor.detach(), [order.index(r) for r in group], op,
                                 self._barrier_of(f"all_reduce({op})", group))
            if inplace and tensor.is_contiguous():
                got = tensor.detach().copy_(got)
            return Pending.done(got.to(tensor.device))
        if inplace and tensor.device == wire and tensor.is_contiguous():
            buf = tensor.detach()
        else:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=wire).copy_(tensor.detach())
        pg = self._pg(group, cuda)
        what = f"all_reduce({op})"
        key, progress = self._key(group, cuda), self.progress
        seq = progress.enter(key, what, waiting=now, members=group)
        try:
            work = pg.allreduce([buf.view(-1)], _OPS[op])
        except RuntimeError as exc:
            progress.leave(key, seq)
            raise self._error(what, group, exc, cuda, seq) from exc

        def finish() -> torch.Tensor:
            if not now:
                dropped.detach()
                progress.blocked(key, seq)
            try:
                work.wait()
            except RuntimeError as exc:
                raise self._error(what, group, exc, cuda, seq) from exc
            finally:
                progress.leave(key, seq)
            return buf.to(tensor.device)
        if not now:  # ``finish`` dies with a Pending dropped unwaited
            dropped = weakref.finalize(finish, progress.dropped, key, seq)
            dropped.atexit = False
        return Pending(finish)

    # -- shared memory on one host (shm_collectives) -------------------------------------------
    def _shared(self, group: tuple, nbytes: int) -> ShmGroup | None:
        """The group's shared-memory segments when a collective of ``nbytes`` per member goes
        through them (every member decides alike: the same sizes, the same environment, the
        agreed set-up); None: through gloo."""
        if len(group) < 2 or nbytes < SHM_MIN or not self._shm_bytes:
            return None
        key = (tuple(sorted(group)), collective_stream())
        if key not in self._shm:
            self._shm[key] = self._join_shared(group)
        shm = self._shm[key]
        return shm if shm is not None and shm.fits(nbytes, len(group)) else None

    def _join_shared(self, group: tuple) -> ShmGroup | None:
        """Make this member's segment, exchange the offers over gloo and map the others'; the
        segments when every member mapped every other's, else None (on every member)."""
        ranks = sorted(group)
        pg = self._pg(group, False)
        shm = ShmGroup(self._shm_bytes)
        offers = torch.zeros(4 * len(ranks), dtype=torch.int64)
        mine = torch.tensor(shm.offer(), dtype=torch.int64)
        self._run("all_gather (shared-memory offers)", group, False,
                  lambda: pg._allgather_base(offers, mine))
        ok = torch.tensor([int(shm.join(ranks.index(self.rank), offers.view(-1, 4).tolist()))])
        self._run("all_reduce (shared-memory set-up)", group, False,
                  lambda: pg.allreduce([ok], dist.ReduceOp.MIN))
        if int(ok):
            return shm
        shm.close()
        return None

    def _barrier_of(self, what: str, group: tuple) -> Callable[[], None]:
        """The group's gloo barrier, recorded (and failing) as a step of collective ``what``."""
        pg = self._pg(group, False)
        return lambda: self._run(f"{what} (shared memory)", group, False, lambda: pg.barrier())

    def _broadcast(self, tensor, src, group):
        """The backend's broadcast of ``src``'s bytes; returns a new tensor on every member."""
        wire, cuda = self._wire(tensor.device)
        buf = torch.empty(tensor.shape, dtype=tensor.dtype, device=wire)
        if self.rank == src:
            buf.copy_(tensor.detach())
        if buf.numel():
            pg = self._pg(group, cuda)
            root = sorted(group).index(src)
            self._run("broadcast", group, cuda, lambda: pg.broadcast(_bytes(buf), root))
        return buf.to(tensor.device)

    def _barrier(self, group):
        pg = self._pg(group, False)
        self._run("barrier", group, False, lambda: pg.barrier())

    def _exchange(self, sends, recvs):
        """Point-to-point on the default group, all posted at once (``batch_isend_irecv``).
        Messages travel through host memory (gloo), or all through the GPU (NCCL) when the
        default group has NCCL, whatever device each side's tensor is on. Same-host messages
        that fit a ring go through the message channels instead (`_ringed`)."""
        if not self.nccl:
            ringed = self._ringed(sends, recvs)
            if ringed is not None:
                return ringed
        if len(sends) + len(recvs) == 1 and not self.nccl and self.world_pg is not None:
            one = self._one_message(sends, recvs)
            if one is not None:
                return one
        wire = self.device("cuda") if self.nccl else torch.device("cpu")
        ops: list[dist.P2POp] = []
        for dst, t in sends:
            if t.numel() == 0:
                continue
            if dst == self.rank:
                self._loopback.append(t.detach().clone())
                continue
            ops.append(dist.P2POp(dist.isend, _bytes(t.to(wire)), dst))
        out: list[Any] = []  # a tensor, or (received on the wire, device) for a network receive
        for rv in recvs:
            src, shape, dtype, device = rv
            if nbytes(shape, dtype) == 0:
                out.append(torch.empty(shape, dtype=dtype, device=device))
            elif src == self.rank:
                if not self._loopback:
                    raise CommError(f"rank {self.rank} receives from itself but sent nothing")
                t = self._loopback.popleft()
                if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                    raise CommError(f"rank {self.rank} expected a {dtype} tensor of shape "
                                    f"{tuple(shape)} from itself, got {t.dtype} {tuple(t.shape)}")
                out.append(t.to(device))
            else:  # received as bytes into a tensor of the right type (no view after)
                buf = torch.empty(shape, dtype=dtype, device=wire)
                ops.append(dist.P2POp(dist.irecv, _bytes(buf), src))
                out.append((buf, device))
        if ops:
            peers = sorted({op.peer for op in ops})
            self._run(f"exchange with ranks {peers}", peers, None,
                      lambda: dist.batch_isend_irecv(ops))
        return [o[0].to(o[1]) if isinstance(o, tuple) else o for o in out]

    def _ringed(self, sends, recvs) -> list[torch.Tensor] | None:
        """`_exchange` with the messages `RingP2P.takes` (both ends decide alike) through the
        message channels: those sends posted first (they do not wait), the rest through gloo,
        then each such receive waited for inside `_run` (progress record, timeout, peers
        named), as gloo's. None when no message of the exchange goes that way."""
        takes = self._p2p.takes
        mine = [takes(dst, nbytes(t)) for dst, t in sends]
        theirs = [takes(rv[0], nbytes(rv[1], rv[2])) for rv in recvs]
        if not any(mine) and not any(theirs):
            return None
        for (dst, t), ringed in zip(sends, mine):
            if ringed:
                self._p2p.send(dst, t)
        rest_s = [s for s, ringed in zip(sends, mine) if not ringed]
        rest_r = [rv for rv, ringed in zip(recvs, theirs) if not ringed]
        rest = iter(self._exchange(rest_s, rest_r) if rest_s or rest_r else [])
        out = []
        for rv, ringed in zip(recvs, theirs):
            if not ringed:
                out.append(next(rest))
                continue
            work = self._p2p.receive(*rv)
            self._run(f"exchange with ranks [{rv[0]}]", (rv[0],), None, lambda: work)
            out.append(work.result)
        return out

    def _one_message(self, sends, recvs) -> list[torch.Tensor] | None:
        """The exchange of one gloo message between host tensors and another rank (a
        stage-to-stage transfer): the default group's own ``send`` / ``recv`` with tag 0, the
        call ``batch_isend_irecv`` makes for a one-op list, without its per-call checks (a
        third of a transfer's CPU on 2 shared cores). None when the exchange is not that (to
        itself, empty, a GPU tensor): the general path takes it."""
        # gloo moves a tensor's bytes (numel x element size) whatever its dtype, as the
        # general path's uint8 views: the two paths pair with each other, and no view is made
        if sends:
            peer, t = sends[0]
            if peer == self.rank or t.device.type != "cpu" or t.numel() == 0:
                return None
            if t.requires_grad:
                t = t.detach()
            data, out = t if t.is_contiguous() else t.contiguous(), []
            start = partial(self.world_pg.send, [data], peer, 0)
        else:
            peer, shape, dtype, device = recvs[0]
            if peer == self.rank or device.type != "cpu" or nbytes(shape, dtype) == 0:
                return None
            buf = torch.empty(shape, dtype=dtype)  # received into it: it is the result
            out = [buf]
            start = partial(self.world_pg.recv, [buf], peer, 0)
        self._run(f"exchange with ranks [{peer}]", (peer,), None, start)
        return out


# -- init under torchrun ---------------------------------------------------------------------
_comm: TorchCommunicator | None = None


def init_from_env(backend: str | None = None) -> TorchCommunicator:
    """Join (or reuse) the default process group described by torchrun's environment.

    ``backend``: ``None`` / ``"gloo"`` / ``"cpu"`` → gloo; ``"nccl"`` / ``"cuda"`` → gloo for
    cpu tensors and NCCL for cuda tensors (the process uses ``cuda:LOCAL_RANK``). The group's
    timeout is `default_timeout()` (``SBPFLOW_TIMEOUT``). Idempotent.
    """
    global _comm
    if dist.is_initialized():
        if _comm is None or _comm.world_pg is not dist.group.WORLD:
            if _comm is not None:  # of a world gone: stop its progress thread first
                _comm.progress.close()
            _comm = TorchCommunicator()
        return _comm
    missing = [k for k in _ENV if not os.environ.get(k)]
    if missing:
        raise CommError(f"the torch backend needs torchrun's environment: {', '.join(missing)} "
                        f"not set. Start the program with `torchrun --nproc-per-node N ...`, "
                        f"or use sbpflow.launch(fn, world_size, backend='torch')")
    want = (backend or "gloo").lower()
    if want in ("nccl", "cuda"):
        if not torch.cuda.is_available():
            raise CommError(f"backend {backend!r} needs CUDA, which is not available")
        n = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", int(os.environ["RANK"]) % n)))
        pg_backend = "cpu:gloo,cuda:nccl"
    elif want in ("gloo", "cpu"):
        pg_backend = "gloo"
    else:
        raise CommError(f"unknown torch backend {backend!r}; use 'gloo' or 'nccl'")
    dist.init_process_group(pg_backend, init_method="env://",
                            timeout=datetime.timedelta(seconds=default_timeout()))
    atexit.register(shutdown)
    _comm = TorchCommunicator()
    return _comm


def shutdown() -> None:
    """Destroy this process's process groups: sbpflow's subgroups, then the default group.

    `init_from_env` registers it with ``atexit``: a process that leaves with gloo groups alive
    tears them down during interpreter finalisation, when their worker threads' work objects
    can no longer be released, and is aborted ("terminate called without an active exception",
    exit code -6) now and then. Idempotent; safe to call by hand before exiting.
    """
    global _comm
    if _comm is not None:
        if current_process() is _comm:  # the process-wide reference keeps groups alive
            set_current(None, process_wide=True)
        _comm.close()
        _comm = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except RuntimeError:  # a backend already broken (a peer died): nothing to release
            pass
