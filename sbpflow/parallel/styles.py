"""Module-aware rule values: ``sf.parallel.colwise`` / ``rowwise`` / ``replicate``.

A rule of ``sf.parallel.apply`` may map a pattern to a `Style` instead of an nd-sbp; it is
resolved for each parameter it matches against the parameter's module (`feature_axes`), so one
rule serves ``nn.Linear`` (weight ``(out, in)``), HF ``Conv1D`` (``(in, out)``, transposed) and
``nn.Embedding`` (``(num, dim)``) alike::

    {"*.c_attn.*": sf.parallel.colwise, "*.c_proj.*": sf.parallel.rowwise, "*": sf.B}

colwise splits the output features (Linear weight S(0), Conv1D weight S(1), bias S(0),
Embedding S(1), a convolution's out channels); rowwise the input features (Linear S(1), Conv1D
S(0), bias B, Embedding S(0): vocabulary-parallel). The split is on one mesh dim
(``mesh_dim``; default the last, or the one that is not ``dp_dim``); every other dim is B.
`replicate` is B on every dim.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import SbpError
from ..nn.torch_layouts import feature_axes
from ..placement import Placement
from ..sbp import B, Split

__all__ = ["Style", "colwise", "rowwise", "replicate"]


@dataclass(frozen=True)
class Style:
    """A parameter layout named by its role in the module (``kind``: "colwise", "rowwise" or
    "replicate") on mesh dim ``mesh_dim`` (None: the placement's last dim, or with ``dp_dim``
    given the one dim that is not ``dp_dim``). Call it to choose the dims:
    ``sf.parallel.colwise(mesh_dim=1)``."""

    kind: str
    mesh_dim: int | None = None
    dp_dim: int | None = None

    def __call__(self, mesh_dim: int | None = None, dp_dim: int | None = None) -> "Style":
        return replace(self, mesh_dim=mesh_dim, dp_dim=dp_dim)

    def __repr__(self) -> str:
        dims = [f"{k}={v}" for k, v in (("mesh_dim", self.mesh_dim), ("dp_dim", self.dp_dim))
                if v is not None]
        return f"sf.parallel.{self.kind}" + (f"({', '.join(dims)})" if dims else "")

    def tp_dim(self, placement: Placement) -> int:
        """The mesh dim this style splits on ``placement``."""
        n = placement.ndim
        for which, d in (("mesh_dim", self.mesh_dim), ("dp_dim", self.dp_dim)):
            if d is not None and not -n <= d < n:
                raise SbpError(f"{self!r}: {which}={d} is not a dim of {placement} ({n}-D)")
        if self.mesh_dim is not None:
            d = self.mesh_dim % n
            if self.dp_dim is not None and d == self.dp_dim % n:
                raise SbpError(f"{self!r}: mesh_dim and dp_dim are the same dim of {placement}")
            return d
        if self.dp_dim is None:
            return n - 1
        rest = [d for d in range(n) if d != self.dp_dim % n]
        if len(rest) != 1:
            why = "no other dim is left to split" if not rest else \
                f"{len(rest)} dims are left: give mesh_dim="
            raise SbpError(f"{self!r} on {placement}: the tensor-parallel dim is the one that is "
                           f"not dp_dim={self.dp_dim}, but {why} (a 2-D mesh dp x tp has one)")
        return rest[0]

    def resolve(self, module, param: str, shape: tuple, placement: Placement) -> tuple:
        """The nd-sbp on ``placement`` of parameter ``param`` (of ``shape``) of ``module``."""
        nd = [B] * placement.ndim
        if self.kind == "replicate":
            return tuple(nd)
        d = self.tp_dim(placement)
        axis = self._axis(module, param, shape)
        if axis is not None:
            nd[d] = Split(axis)
        return tuple(nd)

    def _axis(self, module, param: str, shape: tuple) -> int | None:
        col = self.kind == "colwise"
        if len(shape) == 1:   # a bias (or a 1-D table): follows the output features
            return 0 if col else None
        if len(shape) == 0:
            return None
        axes = feature_axes(module) if param == "weight" else None
        if axes is not None:       # a projection, an embedding, a convolution
            return axes.out if col else axes.inp
        # any other weight: HF's convention for linear-like ones, (..., out, in)
        return len(shape) - 2 if col else len(shape) - 1


colwise = Style("colwise")
rowwise = Style("rowwise")
replicate = Style("replicate")
