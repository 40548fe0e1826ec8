"""The cluster model: nodes × devices, an alpha-beta link inside a node and one between nodes.

    >>> c = Cluster(nodes=2, devices_per_node=8, intra=(3e-6, 1 / 240e9), inter=(1e-5, 8e-11))
    >>> c.world_size, c.node_of(9), c.link([0, 1]) == c.intra, c.link([0, 8]) == c.inter
    (16, 1, True, True)

Ranks are numbered node-major; a group inside one node uses ``intra``, one that spans nodes
``inter``. A `Link` ``(alpha, beta)`` prices ``n`` bytes at ``alpha + n * beta`` seconds.
Calibration may add per-kind fits (``kinds``), a strided-copy cost (``copy_beta``) and a
per-step software cost (``step_overhead``). See docs/auto.md, 'Ranks, links and refinements'.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from ..comm.kinds import ALGORITHMS, KINDS, VARIANTS
from .formulas import CollectiveFit, CostError, Link, collective_time

__all__ = ["Cluster", "Link", "CollectiveFit", "CostError", "PRESETS", "LINK_CLASSES",
           "DEFAULT_FLOPS_PER_DEVICE"]

LINK_CLASSES = ("intra", "inter")

GiB = 2 ** 30


def _fit(value: Any, what: str) -> CollectiveFit:
    """``(alpha, beta[, overhead[, algorithm[, beta2, knee]]])`` -> a checked `CollectiveFit`."""
    given = value = tuple(value) if isinstance(value, (list, tuple)) else value
    algorithm, bend = "", (0.0, 0.0)
    if isinstance(value, tuple) and len(value) in (4, 6):
        value, algorithm, bend = value[:3], value[3], value[4:] or bend
    try:
        vals = [float(v) for v in value]
        bend = [float(v) for v in bend]
        if len(vals) not in (2, 3):
            raise ValueError
    except (TypeError, ValueError):
        raise CostError(f"{what} must be (alpha, beta[, overhead[, algorithm[, beta2, knee]]]) "
                        f"in seconds (knee in bytes), got {given!r}") from None
    vals += [0.0] * (3 - len(vals))
    for name, v in zip(("alpha", "beta", "overhead", "beta2", "knee"), vals + bend):
        if not (math.isfinite(v) and v >= 0):
            raise CostError(f"{what} {name} must be finite and >= 0, got {v!r}")
    if algorithm not in ("",) + ALGORITHMS:
        raise CostError(f"{what} algorithm must be one of {ALGORITHMS} (or ''), "
                        f"got {algorithm!r}")
    return CollectiveFit(*vals, algorithm, *bend)


def _kinds(value: Any) -> tuple:
    """``{link class: {kind: fit}}`` (or the frozen form) -> sorted tuple of
    ``(link class, kind, CollectiveFit)``: hashable, so a Cluster stays a cache key."""
    if not value:
        return ()
    if isinstance(value, tuple):
        try:
            value = {lc: {k: f for l2, k, f in value if l2 == lc} for lc, _, _ in value}
        except (TypeError, ValueError):
            raise CostError(f"Cluster kinds: not a kinds table: {value!r}") from None
    if not isinstance(value, dict):
        raise CostError(f"Cluster kinds must be {{link class: {{kind: (alpha, beta, "
                        f"overhead)}}}}, got {value!r}")
    out = []
    for lc, table in value.items():
        if lc not in LINK_CLASSES or not isinstance(table, dict):
            raise CostError(f"Cluster kinds: link class must be one of {LINK_CLASSES} mapping "
                            f"kinds to fits, got {lc!r}: {table!r}")
        for kind, f in table.items():
            if kind not in KINDS:
                raise CostError(f"Cluster kinds: unknown collective kind {kind!r}; one of {KINDS}")
            fit = _fit(f, f"Cluster kinds[{lc!r}][{kind!r}]")
            if fit.algorithm and (kind, fit.algorithm) not in VARIANTS:
                raise CostError(f"Cluster kinds[{lc!r}][{kind!r}]: {kind} has no "
                                f"{fit.algorithm!r} variant; variants: {sorted(VARIANTS)}")
            out.append((lc, kind, fit))
    return tuple(sorted(out))


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
    # flops: A100 dense bf16/fp16 tensor-core peak, 312 TFLOP/s, of which layers achieve 0.58:
    # fitted once, the geometric mean over the 10 rows of the Megatron-LM paper's Table 1 of
    # predicted / measured TFLOP/s being 1, each row's configuration run as the paper ran it,
    # with full activation recomputation (docs/auto.md, 'Against Megatron-LM').
    "dgx-a100": dict(devices_per_node=8, intra=(3e-6, 1 / 240e9), inter=(1e-5, 1 / 12.5e9),
                     memory_per_device=80 * GiB, flops_per_device=312e12,
                     compute_efficiency=0.58),
    # A supercomputer with one GPU a node (Piz Daint-like: one P100-16GB a node, Cray Aries
    # dragonfly, ~1.5 us MPI latency, ~10 GB/s injection bandwidth a node). intra is never used
    # (a one-rank group costs nothing); it is set to PCIe 3 x16 figures for completeness.
    # flops: P100 fp16 peak, 18.7 TFLOP/s.
    "supercomputer": dict(devices_per_node=1, intra=(5e-6, 1 / 12e9), inter=(1.5e-6, 1 / 10e9),
                          memory_per_device=16 * GiB, flops_per_device=18.7e12),
}
PRESETS["piz-daint"] = PRESETS["supercomputer"]

# The device speed assumed when a cluster does not say (``flops_per_device=None``), so that
# compute is never free: a device doing the whole work of a layer that p devices could share
# is charged for it. 100 TFLOP/s is about what an A100 sustains on large bf16 matmuls (a third
# of its 312 TFLOP/s peak); only the ratio of compute to communication matters to a search.
DEFAULT_FLOPS_PER_DEVICE = 100e12


@dataclass(frozen=True)
class Cluster:
    """``nodes`` × ``devices_per_node`` devices; ``intra`` / ``inter`` are `Link` s (or
    ``(alpha, beta)`` pairs); ``memory_per_device`` in bytes; ``flops_per_device`` in FLOP/s
    (None: unknown, priced at `DEFAULT_FLOPS_PER_DEVICE`), of which layers achieve the
    fraction ``compute_efficiency``; optional per-kind fits ``kinds``, local copy cost
    ``copy_beta`` and per-step software cost ``step_overhead`` (docs/auto.md, 'Ranks, links
    and refinements'; default: none, the plain alpha-beta model). Immutable and hashable."""

    nodes: int = 1
    devices_per_node: int = 1
    intra: Link = Link(0.0, 0.0)
    inter: Link = Link(0.0, 0.0)
    memory_per_device: float = 80 * GiB
    flops_per_device: float | None = None
    name: str = field(default="custom", compare=False)
    kinds: Any = ()          # {link class: {kind: CollectiveFit}}; stored as a sorted tuple
    copy_beta: float = 0.0   # s per byte of a local copy through a non-contiguous view
    step_overhead: float = 0.0  # s of software work per boxing step
    compute_efficiency: float = 1.0  # fraction of flops_per_device layers achieve

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
        object.__setattr__(self, "kinds", _kinds(self.kinds))
        cb = self.copy_beta
        if isinstance(cb, bool) or not isinstance(cb, (int, float)) or \
                not (math.isfinite(cb) and cb >= 0):
            raise CostError(f"Cluster copy_beta must be a finite number >= 0, got {cb!r}")
        object.__setattr__(self, "copy_beta", float(cb))
        so = self.step_overhead
        if isinstance(so, bool) or not isinstance(so, (int, float)) or \
                not (math.isfinite(so) and so >= 0):
            raise CostError(f"Cluster step_overhead must be a finite number >= 0, got {so!r}")
        object.__setattr__(self, "step_overhead", float(so))
        ce = self.compute_efficiency
        if isinstance(ce, bool) or not isinstance(ce, (int, float)) or not 0 < ce <= 1:
            raise CostError(f"Cluster compute_efficiency must be in (0, 1], got {ce!r}")
        object.__setattr__(self, "compute_efficiency", float(ce))

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
                                    "flops_per_device", "name", "kinds", "copy_beta",
                                    "step_overhead", "compute_efficiency"}
        if unknown:
            raise CostError(f"Cluster.preset: unknown field(s) {sorted(unknown)}")
        kw = dict(base, name=name, nodes=nodes)
        kw.update(overrides)
        return cls(**kw)

    # -- topology -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Devices of the cluster: ``nodes * devices_per_node``."""
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

    def link_class(self, ranks: Iterable[int]) -> str:
        """``"inter"`` if ``ranks`` span nodes, else ``"intra"``."""
        return "inter" if self.spans_nodes(ranks) else "intra"

    def fit(self, kind: str, ranks: Iterable[int]) -> CollectiveFit:
        """The parameters collective ``kind`` over ``ranks`` is priced with: the per-kind fit of
        the group's link class if the cluster has one, else the link's ``(alpha, beta)`` and no
        overhead."""
        ranks = tuple(ranks)
        lc = self.link_class(ranks)
        for l2, k, f in self.kinds:
            if l2 == lc and k == kind:
                return f
        a, b = self.intra if lc == "intra" else self.inter
        return CollectiveFit(a, b, 0.0)

    @property
    def kinds_table(self) -> dict:
        """``kinds`` as ``{link class: {kind: CollectiveFit}}``."""
        out: dict = {}
        for lc, k, f in self.kinds:
            out.setdefault(lc, {})[k] = f
        return out

    # -- time -----------------------------------------------------------------------------------
    def collective_time(self, kind: str, nbytes: float, ranks: Iterable[int]) -> float:
        """Seconds for collective ``kind`` about a tensor of ``nbytes`` over the group ``ranks``
        (see `sbpflow.cost.formulas`; a one-rank group costs 0)."""
        ranks = tuple(ranks)
        return collective_time(kind, nbytes, len(ranks), self.fit(kind, ranks))

    def copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` locally through a non-contiguous view: ``nbytes ·
        copy_beta``."""
        return nbytes * self.copy_beta

    @property
    def device_flops(self) -> float:
        """FLOP/s a layer achieves on one device: ``flops_per_device`` (or
        `DEFAULT_FLOPS_PER_DEVICE`) times ``compute_efficiency``."""
        peak = DEFAULT_FLOPS_PER_DEVICE if self.flops_per_device is None else \
            self.flops_per_device
        return peak * self.compute_efficiency

    def compute_time(self, flops: float) -> float:
        """Seconds for ``flops`` floating-point operations on one device (`device_flops`)."""
        return flops / self.device_flops

    # -- files ----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The cluster as plain data (``format`` ``sbpflow-cluster/1``), for JSON."""
        return {"format": "sbpflow-cluster/1", "name": self.name, "nodes": self.nodes,
                "devices_per_node": self.devices_per_node,
                "intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
                "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
                "memory_per_device": self.memory_per_device,
                "flops_per_device": self.flops_per_device,
                "kinds": {lc: {k: f._asdict() for k, f in t.items()}
                          for lc, t in self.kinds_table.items()},
                "copy_beta": self.copy_beta, "step_overhead": self.step_overhead,
                "compute_efficiency": self.compute_efficiency}

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        """The cluster of a dict made by `to_dict` (a JSON file's content); a bad one raises
        `CostError`."""
        try:
            if d.get("format", "sbpflow-cluster/1") != "sbpflow-cluster/1":
                raise CostError(f"unsupported cluster format {d.get('format')!r}")
            return cls(nodes=d["nodes"], devices_per_node=d["devices_per_node"],
                       intra=(d["intra"]["alpha"], d["intra"]["beta"]),
                       inter=(d["inter"]["alpha"], d["inter"]["beta"]),
                       memory_per_device=d["memory_per_device"],
                       flops_per_device=d.get("flops_per_device"),
                       name=d.get("name", "custom"),
                       kinds={lc: {k: (f["alpha"], f["beta"], f.get("overhead", 0.0),
                                       f.get("algorithm", ""), f.get("beta2", 0.0),
                                       f.get("knee", 0.0))
                                   for k, f in t.items()}
                              for lc, t in (d.get("kinds") or {}).items()},
                       copy_beta=d.get("copy_beta", 0.0),
                       step_overhead=d.get("step_overhead", 0.0),
                       compute_efficiency=d.get("compute_efficiency", 1.0))
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
        flops = f", {DEFAULT_FLOPS_PER_DEVICE / 1e12:.4g} TFLOP/s (default)" \
            if self.flops_per_device is None else f", {self.flops_per_device / 1e12:.4g} TFLOP/s"
        if self.compute_efficiency != 1.0:
            flops += f" at {self.compute_efficiency:.3g} efficiency"
        extra = ""
        if self.kinds:
            extra += f"; per-kind fits for {len(self.kinds)} (link, kind)"
        if self.copy_beta:
            extra += f"; strided copy {self.copy_beta * 1e12:.4g} ps/B"
        if self.step_overhead:
            extra += f"; {self.step_overhead * 1e6:.3g} us a boxing step"
        return (f"Cluster({self.name}: {self.nodes} node(s) x {self.devices_per_node} device(s), "
                f"{self.memory_per_device / GiB:.4g} GiB{flops}; intra {self.intra}; "
                f"inter {self.inter}{extra})")
