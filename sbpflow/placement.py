"""Placement: a device type and an N-D array of ranks (the mesh).

    >>> mesh = placement("cpu", ranks=[[0, 1], [2, 3]])
    >>> mesh.shape, mesh.ndim, mesh.coord_of(2)
    ((2, 2), 2, (1, 0))
    >>> mesh.group(dims=(1,), coord=(1, 0))
    (2, 3)

Mesh dim 0 is the outermost (e.g. across nodes); the last dim is innermost (inside a node).
"""

from __future__ import annotations

import itertools
import math
from typing import Iterable, Sequence

from .errors import PlacementError

__all__ = ["Placement", "placement", "DEVICE_TYPES"]

DEVICE_TYPES = ("cpu", "cuda")


def _shape_and_flat(ranks) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and row-major flattening of a nested list of ints (or a torch/numpy array)."""
    if hasattr(ranks, "tolist"):
        ranks = ranks.tolist()
    if isinstance(ranks, range):
        ranks = list(ranks)
    if isinstance(ranks, int):
        raise PlacementError(f"ranks must be a list (e.g. [0, 1] or [[0, 1], [2, 3]]), got {ranks}")
    if not isinstance(ranks, (list, tuple)) or len(ranks) == 0:
        raise PlacementError(f"ranks must be a non-empty (nested) list of ints, got {ranks!r}")
    if all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
        return (len(ranks),), tuple(ranks)
    if any(not isinstance(r, (list, tuple, range)) for r in ranks):
        raise PlacementError(f"ranks mix ints and lists: {ranks!r}")
    subs = [_shape_and_flat(r) for r in ranks]
    inner = subs[0][0]
    if any(s != inner for s, _ in subs):
        raise PlacementError(f"ragged ranks {ranks!r}: every row of the mesh needs the same shape")
    return (len(ranks),) + inner, tuple(r for _, flat in subs for r in flat)


class Placement:
    """A device type and an N-D mesh of global ranks. Immutable, hashable, comparable."""

    __slots__ = ("_device_type", "_shape", "_flat", "_index", "_hash")

    def __init__(self, device_type: str, ranks, *, shape: Sequence[int] | None = None) -> None:
        if device_type not in DEVICE_TYPES:
            raise PlacementError(f"device type must be one of {DEVICE_TYPES}, got {device_type!r}")
        mesh_shape, flat = _shape_and_flat(ranks)
        if shape is not None:
            shape = tuple(int(s) for s in shape)
            if math.prod(shape) != len(flat):
                raise PlacementError(f"mesh shape {shape} does not hold {len(flat)} ranks")
            mesh_shape = shape
        for r in flat:
            if not isinstance(r, int) or r < 0:
                raise PlacementError(f"ranks must be non-negative ints, got {r!r} in {ranks!r}")
        if len(set(flat)) != len(flat):
            dup = sorted({r for r in flat if flat.count(r) > 1})
            raise PlacementError(f"duplicate ranks {dup} in placement ranks {ranks!r}")
        self._device_type = device_type
        self._shape = mesh_shape
        self._flat = flat
        self._index = {r: i for i, r in enumerate(flat)}
        self._hash = hash((device_type, mesh_shape, flat))  # placements key many caches

    # -- metadata ---------------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``."""
        return self._device_type

    @property
    def shape(self) -> tuple[int, ...]:
        """The mesh's shape, e.g. ``(2, 2)``."""
        return self._shape

    @property
    def ndim(self) -> int:
        """The number of mesh dims (entries of an nd-sbp on it)."""
        return len(self._shape)

    @property
    def size(self) -> int:
        """The number of ranks."""
        return len(self._flat)

    @property
    def flat_ranks(self) -> tuple[int, ...]:
        """The ranks in row-major mesh order."""
        return self._flat

    @property
    def ranks(self) -> list:
        """The mesh as a nested list, as given to the constructor."""
        out: list = list(self._flat)
        for n in reversed(self._shape[1:]):
            out = [out[i:i + n] for i in range(0, len(out), n)]
        return out

    def __contains__(self, rank: int) -> bool:
        return rank in self._index

    def __iter__(self):
        return iter(self._flat)

    # -- coordinates ------------------------------------------------------------------------
    def coord_of(self, rank: int) -> tuple[int, ...]:
        """Mesh coordinate of ``rank``; raises `PlacementError` if it is not in the mesh."""
        try:
            i = self._index[rank]
        except KeyError:
            raise PlacementError(f"rank {rank} is not in {self}") from None
        coord = []
        for n in reversed(self._shape):
            i, c = divmod(i, n)
            coord.append(c)
        return tuple(reversed(coord))

    def rank_at(self, coord: Sequence[int]) -> int:
        """The rank at mesh coordinate ``coord``."""
        i = 0
        for c, n in zip(coord, self._shape):
            i = i * n + c
        return self._flat[i]

    def coords(self) -> Iterable[tuple[int, ...]]:
        """All mesh coordinates in row-major order."""
        return itertools.product(*(range(n) for n in self._shape))

    def group(self, dims: Sequence[int], coord: Sequence[int]) -> tuple[int, ...]:
        """Ranks that differ from ``coord`` only along mesh ``dims``, row-major over ``dims``."""
        dims = tuple(dims)
        out = []
        for sub in itertools.product(*(range(self._shape[d]) for d in dims)):
            c = list(coord)
            for d, v in zip(dims, sub):
                c[d] = v
            out.append(self.rank_at(c))
        return tuple(out)

    def index_in_group(self, dims: Sequence[int], coord: Sequence[int]) -> int:
        """Position of ``coord`` inside its group along ``dims`` (row-major over ``dims``)."""
        i = 0
        for d in dims:
            i = i * self._shape[d] + coord[d]
        return i

    # -- derived placements -----------------------------------------------------------------
    def sub(self, dim: int, index: int) -> "Placement":
        """The (ndim-1)-D placement at ``index`` along mesh ``dim`` (a 1-D mesh gives [rank])."""
        if not 0 <= dim < self.ndim or not 0 <= index < self._shape[dim]:
            raise PlacementError(f"no index {index} along dim {dim} of mesh shape {self._shape}")
        coords = [c for c in self.coords() if c[dim] == index]
        ranks = [self.rank_at(c) for c in coords]
        shape = self._shape[:dim] + self._shape[dim + 1:] or (1,)
        return Placement(self._device_type, ranks, shape=shape)

    def __getitem__(self, index: int) -> "Placement":
        return self.sub(0, index)

    def reshape(self, *shape: int) -> "Placement":
        """The same ranks, row-major, as a mesh of ``shape``."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return Placement(self._device_type, list(self._flat), shape=shape)

    def flatten(self) -> "Placement":
        """The same ranks as a 1-D mesh."""
        return self.reshape(self.size)

    def with_device_type(self, device_type: str) -> "Placement":
        """The same mesh on ``device_type`` devices."""
        return Placement(device_type, list(self._flat), shape=self._shape)

    def check_world(self, world_size: int) -> None:
        """Raise `PlacementError` if some rank is outside ``0..world_size-1``."""
        bad = [r for r in self._flat if r >= world_size]
        if bad:
            raise PlacementError(
                f"{self} uses rank(s) {bad} but the world has only {world_size} rank(s) "
                f"(0..{world_size - 1})")

    # -- value semantics --------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        return (isinstance(other, Placement) and self._hash == other._hash
                and self._device_type == other._device_type
                and self._shape == other._shape and self._flat == other._flat)

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        return f"placement({self._device_type!r}, ranks={self.ranks})"

    def __str__(self) -> str:
        return f"{self._device_type}{self.ranks}".replace(" ", "")


def placement(device_type: str = "cpu", ranks=None, *, shape: Sequence[int] | None = None) -> Placement:
    """A `Placement` over ``ranks`` (nested list, 1-D..N-D), optionally reshaped to ``shape``.

    ``placement("cpu", ranks=[0, 1, 2, 3])`` is a 1-D mesh; ``ranks=[[0, 1], [2, 3]]`` a 2×2 one.
    """
    if ranks is None:
        raise PlacementError("placement needs ranks, e.g. placement('cpu', ranks=[0, 1])")
    return Placement(device_type, ranks, shape=shape)
