"""The cluster model: nodes × devices, an alpha-beta link inside a node and one between nodes.

    >>> c = Cluster(nodes=2, devices_per_node=8, intra=(3e-6, 1 / 240e9), inter=(1e-5, 8e-11))
    >>> c.world_size, c.node_of(9), c.link([0, 1]) == c.intra, c.link([0, 8]) == c.inter
    (16, 1, True, True)

Ranks are numbered node-major: rank ``r`` is device ``r % devices_per_node`` of node
``r // devices_per_node`` (the order torchrun gives ranks). A group of ranks that lies inside one
node communicates over ``intra``; a group that spans nodes over ``inter`` (for the whole
collective: no hierarchical algorithm is modelled). Mesh dims map onto this hierarchy through the
ranks they group: on ``ranks=[[0..7], [8..15]]`` with 8 devices a node, mesh dim 1 is intra-node
and mesh dim 0 inter-node.

A `Link` is ``(alpha, beta)``: a message of ``n`` bytes over it takes ``alpha + n * beta``
seconds. ``beta`` is per device: every device has its own path to the others at that speed,
and concurrent groups do not slow each other down (no contention is modelled).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from ..errors import SbpError

__all__ = ["Cluster", "Link", "CostError", "PRESETS"]

GiB = 2 ** 30


class CostError(SbpError, ValueError):
    """A cost-model request that cannot be answered (bad cluster, unknown kind, rank outside)."""


class Link(NamedTuple):
    """Latency ``alpha`` (s per message) and inverse bandwidth ``beta`` (s per byte)."""

    alpha: float
    beta: float

    @property
    def bandwidth(self) -> float:
        """Bytes per second (``1 / beta``; inf for a free link)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def time(self, nbytes: float, messages: float = 1) -> float:
        """Seconds for ``messages`` messages carrying ``nbytes`` bytes in total."""
        return messages * self.alpha + nbytes * self.beta

    def __str__(self) -> str:
        return f"alpha {self.alpha * 1e6:.3g} us, beta {self.beta * 1e12:.4g} ps/B " \
               f"({self.bandwidth / 1e9:.4g} GB/s)"


def _link(value: Any, what: str) -> Link:
    try:
        alpha, beta = (float(v) for v in value)
    except (TypeError, ValueError):
        raise CostError(f"{what} must be (alpha seconds, beta seconds per byte), got {value!r}") \
            from None
    for name, v in (("alpha", alpha), ("beta", beta)):
        if not (math.isfinite(v) and v >= 0):
            raise CostError(f"{what} {name} must be finite and >= 0, got {v!r}")
    return Link(alpha, beta)


# Named clusters. Numbers are public peak / typical figures, not measurements of any machine;
# calibrate on the real one (`sbpflow calibrate`) before trusting absolute times.
PRESETS: dict[str, dict] = {
    # DGX A100: 8 A100-80GB a node on NVLink 3 / NVSwitch (~240 GB/s bus bandwidth a GPU as
    # NCCL measures it, ~3 us latency); 100 Gb/s (12.5 GB/s) between nodes a device, ~10 us.
    # flops: A100 dense bf16/fp16 tensor-core peak, 312 TFLOP/s.
    "dgx-a100": dict(devices_per_node=8, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                     memory_per_device=80 * GiB, flops_per_device=312e12),
    # A supercomputer with one GPU a node (Piz Daint-like: one P100-16GB a node, Cray Aries
    # dragonfly, ~1.5 us MPI latency, ~10 GB/s injection bandwidth a node). intra is never used
    # (a one-rank group costs nothing); it is set to PCIe 3 x16 figures for completeness.
    # flops: P100 fp16 peak, 18.7 TFLOP/s.
    "supercomputer": dict(devices_per_node=1, intra=(5e-6, 1 / 12e9), inter=(1.5e-6, 1 / 10e9),
                          memory_per_device=16 * GiB, flops_per_device=18.7e12),
}
PRESETS["piz-daint"] = PRESETS["supercomputer"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``devices_per_node`` devices; ``intra`` / ``inter`` are `Link` s (or
    ``(alpha, beta)`` pairs); ``memory_per_device`` in bytes; ``flops_per_device`` in FLOP/s
    (None: unknown, compute time not modelled). Immutable and hashable."""

    nodes: int = 1
    devices_per_node: int = 1
    intra: Link = Link(0.0, 0.0)
    inter: Link = Link(0.0, 0.0)
    memory_per_device: float = 80 * GiB
    flops_per_device: float | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        for what in ("nodes", "devices_per_node"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise CostError(f"Cluster {what} must be a positive int, got {v!r}")
        object.__setattr__(self, "intra", _link(self.intra, "Cluster intra"))
        object.__setattr__(self, "inter", _link(self.inter, "Cluster inter"))
        mem = self.memory_per_device
        if not isinstance(mem, (int, float)) or isinstance(mem, bool) or not mem > 0:
            raise CostError(f"Cluster memory_per_device must be a positive number of bytes, "
                            f"got {mem!r}")
        f = self.flops_per_device
        if f is not None and (not isinstance(f, (int, float)) or isinstance(f, bool) or not f > 0):
            raise CostError(f"Cluster flops_per_device must be None or positive, got {f!r}")

    # -- presets --------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, nodes: int = 1, **overrides) -> "Cluster":
        """A named cluster (`PRESETS`: ``"dgx-a100"``, ``"supercomputer"`` alias
        ``"piz-daint"``) of ``nodes`` nodes; keyword arguments override any field."""
        try:
            base = PRESETS[name]
        except KeyError:
            raise CostError(f"unknown cluster preset {name!r}; choose from "
                            f"{sorted(PRESETS)}") from None
        unknown = set(overrides) - {"devices_per_node", "intra", "inter", "memory_per_device",
                                    "flops_per_device", "name"}
        if unknown:
            raise CostError(f"Cluster.preset: unknown field(s) {sorted(unknown)}")
        kw = dict(base, name=name, nodes=nodes)
        kw.update(overrides)
        return cls(**kw)

    # -- topology -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node that holds ``rank`` (ranks are node-major)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise CostError(f"rank {rank!r} is outside {self} (ranks 0..{self.world_size - 1})")
        return rank // self.devices_per_node

    def spans_nodes(self, ranks: Iterable[int]) -> bool:
        """Whether ``ranks`` lie on more than one node."""
        return len({self.node_of(r) for r in ranks}) > 1

    def link(self, ranks: Iterable[int]) -> Link:
        """``inter`` if ``ranks`` span nodes, else ``intra``."""
        return self.inter if self.spans_nodes(ranks) else self.intra

    # -- time -----------------------------------------------------------------------------------
    def collective_time(self, kind: str, nbytes: float, ranks: Iterable[int]) -> float:
        """Seconds for collective ``kind`` about a tensor of ``nbytes`` over the group ``ranks``
        (see `sbpflow.cost.collectives` for the formulas; a one-rank group costs 0)."""
        from .collectives import collective_time
        ranks = tuple(ranks)
        return collective_time(kind, nbytes, len(ranks), self.link(ranks))

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` floating-point operations on one device at peak."""
        if self.flops_per_device is None:
            raise CostError(f"{self} has no flops_per_device: compute time is not modelled")
        return flops / self.flops_per_device

    # -- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": "sbpflow-cluster/1", "name": self.name, "nodes": self.nodes,
                "devices_per_node": self.devices_per_node,
                "intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
                "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
                "memory_per_device": self.memory_per_device,
                "flops_per_device": self.flops_per_device}

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        try:
            if d.get("format", "sbpflow-cluster/1") != "sbpflow-cluster/1":
                raise CostError(f"unsupported cluster format {d.get('format')!r}")
            return cls(nodes=d["nodes"], devices_per_node=d["devices_per_node"],
                       intra=(d["intra"]["alpha"], d["intra"]["beta"]),
                       inter=(d["inter"]["alpha"], d["inter"]["beta"]),
                       memory_per_device=d["memory_per_device"],
                       flops_per_device=d.get("flops_per_device"),
                       name=d.get("name", "custom"))
        except (KeyError, TypeError, AttributeError) as exc:
            raise CostError(f"not a cluster description ({type(exc).__name__}: {exc}): "
                            f"{str(d)[:200]}") from None

    def save(self, path: str | os.PathLike, extra: dict | None = None) -> None:
        """Write the cluster as JSON; ``extra`` (e.g. a calibration report) is stored alongside
        under ``"calibration"`` and ignored by `load`."""
        d = self.to_dict()
        if extra is not None:
            d["calibration"] = extra
        with open(path, "w") as f:
            json.dump(d, f, indent=2)
            f.write("\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Cluster":
        """The cluster `save` wrote to ``path``."""
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise CostError(f"cannot read a cluster from {str(path)!r}: {exc}") from None
        if not isinstance(d, dict):
            raise CostError(f"{str(path)!r} does not hold a cluster description")
        return cls.from_dict(d)

    def __str__(self) -> str:
        flops = "" if self.flops_per_device is None else \
            f", {self.flops_per_device / 1e12:.4g} TFLOP/s"
        return (f"Cluster({self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s), "
                f"{self.memory_per_device / GiB:.4g} GiB{flops}; intra {self.intra}; "
                f"inter {self.inter})")
