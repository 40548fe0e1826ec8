"""Point-to-point messages between two processes of one host through the message channels
(`socket_channels`), whose large tensors go through the pair's shared-memory ring (`shm_ring`):
the torch backend's `send` / `recv` (a pipeline stage's activations and gradients) without
gloo's own transfer.

Off unless ``SBPFLOW_P2P_RING=1`` (measured slower than gloo in graph pipelines on 2 cores:
the receiving thread needs the GIL, which a stage's Python holds; docs/performance.md). A
message takes this path when both ends decide alike, from what both know (`RingP2P.takes`):
no NCCL, rings on (``SBPFLOW_SHM_RING_MB``), its bytes nonzero and at most half a ring, and
both processes listening for channels on the same host; else gloo as before. A receive waits as a gloo one does, inside the backend's `_run` (its
progress record, its timeout: `CommTimeout` naming the culprits); a sender's connection that
closes (its process ended) fails the wait at once. See docs/runtime.md, 'Message channels'.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Any, Callable

import torch

from ..errors import CommError
from .shm_ring import ring_bytes

__all__ = ["RingP2P", "CHANNEL"]

CHANNEL = "\x00sbpflow/p2p<"  # + the sender's rank: the receiver's channel for its messages
_SLICE = 0.5  # s a receive waits at a time before it looks whether its sender is gone


class RingP2P:
    """The same-host point-to-point path of one `TorchCommunicator`: ``chan()`` gives its
    `SocketChannels`; ``timeout``: s a receive waits (the backend's collective timeout)."""

    def __init__(self, rank: int, chan: Callable[[], Any], timeout: float) -> None:
        self.rank, self._chan, self.timeout = rank, chan, timeout
        self._cap = ring_bytes() // 2 if os.environ.get("SBPFLOW_P2P_RING") == "1" else 0
        self._near: dict[int, bool] = {}  # peer -> on this host, listening (`takes`)
        self._pending: dict[int, deque] = {}  # src -> messages taken from its channel, unread
        self._lock = threading.Lock()

    def takes(self, peer: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` between this rank and ``peer`` goes this way (both
        ends answer alike: the sizes, the environment and the published addresses are the
        same on both)."""
        if not 0 < nbytes <= self._cap or peer == self.rank:
            return False
        near = self._near.get(peer)
        if near is None:
            near = self._near[peer] = self._chan().same_host(peer)
        return near

    def send(self, dst: int, tensor: torch.Tensor) -> None:
        """Post ``tensor``'s bytes to ``dst`` (host memory; returns once handed over)."""
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        self._chan().post(self.rank, dst, f"{CHANNEL}{self.rank}", t)

    def receive(self, src: int, shape: tuple, dtype: torch.dtype,
                device: torch.device) -> "_Receive":
        """A wait (``.wait()``, as a gloo work's, inside the backend's `_run`) for the next
        message from ``src``; ``.result`` is the tensor once it returned."""
        return _Receive(self, src, tuple(shape), dtype, device)

    def _take(self, src: int, timeout: float) -> Any:
        """The next message from ``src`` (None: none within ``timeout`` s)."""
        with self._lock:
            queue = self._pending.setdefault(src, deque())
            if queue:
                return queue.popleft()
        got = self._chan().take(self.rank, f"{CHANNEL}{src}", timeout, lambda: None)
        with self._lock:
            queue.extend(m for _, m in got)
            return queue.popleft() if queue else None


class _Receive:
    """One receive from ``src``: `wait` blocks until the message is in (its shape and dtype
    checked) or raises a RuntimeError that the backend's `_run` turns into its timeout or
    closed-connection error (naming the peers from the progress records)."""

    def __init__(self, p2p: RingP2P, src: int, shape: tuple, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.p2p, self.src, self.shape, self.dtype, self.device = p2p, src, shape, dtype, device
        self.result: torch.Tensor | None = None

    def wait(self) -> None:
        timeout = self.p2p.timeout
        deadline = time.monotonic() + timeout
        chan = self.p2p._chan()
        while True:
            left = deadline - time.monotonic()
            got = self.p2p._take(self.src, max(0.0, min(_SLICE, left)))
            if got is not None:
                break
            if not chan.connected_from(self.src) and \
                    (got := self.p2p._take(self.src, 0.0)) is None:  # (what came before EOF)
                raise RuntimeError(f"Connection closed by peer: rank {self.src}'s message "
                                   f"connection to rank {self.p2p.rank} closed")
            if got is not None:
                break
            if left <= 0:
                raise RuntimeError(f"timed out after {timeout:g} s waiting for a message from "
                                   f"rank {self.src} (same-host channel)")
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != self.shape \
                or got.dtype != self.dtype:
            what = (f"{got.dtype} tensor of shape {tuple(got.shape)}"
                    if isinstance(got, torch.Tensor) else type(got).__name__)
            raise CommError(f"rank {self.p2p.rank} expected a {self.dtype} tensor of shape "
                            f"{self.shape} from rank {self.src}, got a {what} (the ranks' "
                            f"transfers are out of step)")
        self.result = got if self.device.type == "cpu" else got.to(self.device)
