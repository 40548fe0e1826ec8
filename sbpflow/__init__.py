"""sbpflow: write the program once, as for one device; say how each tensor is laid out over a
mesh of devices (split / broadcast / partial per mesh dim); sbpflow inserts the communication.

    import sbpflow as sf
    mesh = sf.placement("cpu", ranks=[[0, 1], [2, 3]])
    x = sf.randn(6, 10, placement=mesh, sbp=(sf.S(0), sf.S(1)), seed=0)
    y = x.to_global(sbp=(sf.B, sf.S(0)))
"""

from . import boxing, comm, cost, ops, sbp
from .caches import cache_info, clear_caches
from .comm import init, launch, rank, world_size
from . import errors
from .errors import CheckpointError, CommError, GraphError, PlacementError, SbpError, ShapeError
from .placement import Placement, placement
from .layouts import Layout
from .sbp import B, P, S, Broadcast, Partial, Split, dual, dual_nd, parse_nd_sbp, parse_sbp
from .tensor import (GlobalTensor, apply_op, arange, from_local, full, manual_seed, ones, rand,
                     randn, tensor, zeros)
from .tensor import cat
from . import nn  # noqa: E402  (above tensor in the layers)
from . import optim, parallel  # noqa: E402
from . import memory  # noqa: E402  (what each rank holds; below zero, nn and optim in the layers)
from .memory import memory_stats  # noqa: E402
from . import runtime  # noqa: E402  (runtime, then graph: it lowers steps to runtime plans)
from . import graph  # noqa: E402
nn.Graph = graph.Graph  # sf.nn.Graph, OneFlow's name (the class lives in the graph layer)
nn.GraphConfig = graph.GraphConfig
from . import data  # noqa: E402  (above nn, optim, tensor)
from . import auto  # noqa: E402
from .nn.amp import autocast  # noqa: E402
from .nn.serialization import load, save  # noqa: E402
from .nn.safetensors_io import export  # noqa: E402
from .parallel.pretrained import load_pretrained  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "boxing", "comm", "cost", "ops", "nn", "apply_op", "sbp", "init", "launch", "rank",
    "world_size", "Placement", "placement", "Layout", "S", "B", "P", "Split", "Broadcast",
    "Partial", "dual", "dual_nd", "parse_sbp", "parse_nd_sbp", "GlobalTensor", "cat", "tensor",
    "from_local", "randn", "rand", "zeros", "ones", "full", "arange", "manual_seed",
    "clear_caches", "cache_info", "errors", "SbpError", "PlacementError", "ShapeError",
    "CommError", "CheckpointError", "GraphError", "data", "optim", "parallel", "save", "load",
    "export", "load_pretrained", "autocast", "auto", "memory", "memory_stats",
]

_MOVED_ERRORS = frozenset(  # sf.X -> sf.errors.X; the old spelling warns once, for one release
    name for name in dir(errors) if isinstance(getattr(errors, name), type)
    and issubclass(getattr(errors, name), SbpError) and name not in __all__)
_WARNED: set = set()


def __getattr__(name: str):
    """``sf.SignatureError`` and the other long-tail errors moved to ``sf.errors``: the old name
    still works for one release, with a DeprecationWarning the first time."""
    if name in _MOVED_ERRORS:
        if name not in _WARNED:
            _WARNED.add(name)
            import warnings
            warnings.warn(f"sf.{name} moved to sf.errors.{name}", DeprecationWarning, stacklevel=2)
        return getattr(errors, name)
    raise AttributeError(f"module 'sbpflow' has no attribute {name!r}")
