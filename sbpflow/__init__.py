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
from .errors import ActorAborted, ActorTimeout, GraphError, PlanError
from .errors import (AdvancedIndexError, BoxingError, CheckpointError, CheckpointKeyError,
                     CheckpointShapeError,
                     CommAborted, CommError,
                     CommTimeout, CostError, DataLoaderConfigError, DataLoaderError,
                     DtypeMismatchError, IndexOutOfRange,
                     OptimizerStateError, ParallelizeError, PlacementError,
                     PlacementMismatchError, SbpError, SbpParseError, SearchCliError,
                     SearchInputError, ShapeError, SignatureError, SplitAxisError,
                     StateDictError, TraceError, UnmatchedParameterError, WireError)
from .placement import Placement, placement
from .sbp import B, P, S, Broadcast, Partial, Split, dual, dual_nd, parse_nd_sbp, parse_sbp
from .tensor import (GlobalTensor, apply_op, arange, from_local, full, manual_seed, ones, rand,
                     randn, tensor, zeros)
from .tensor import UnsupportedTorchFunction, cat
from . import nn  # noqa: E402  (above tensor in the layers)
from . import optim, parallel  # noqa: E402
from . import memory  # noqa: E402  (above nn and optim)
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
    "boxing", "comm", "cost", "ops", "nn", "apply_op", "sbp", "init", "launch", "rank", "world_size", "Placement", "placement",
    "S", "B", "P", "Split", "Broadcast", "Partial", "dual", "dual_nd", "parse_sbp", "parse_nd_sbp",
    "GlobalTensor", "cat", "tensor", "from_local", "randn", "rand", "zeros", "ones", "full", "arange",
    "manual_seed", "clear_caches", "cache_info", "SbpError", "SbpParseError", "SplitAxisError", "PlacementError",
    "PlacementMismatchError", "ShapeError", "SignatureError", "BoxingError", "CommError",
    "ActorAborted", "ActorTimeout", "GraphError", "PlanError",
    "CommAborted", "CommTimeout", "DtypeMismatchError", "IndexOutOfRange", "AdvancedIndexError",
    "CostError", "StateDictError", "CheckpointError", "OptimizerStateError",
    "UnmatchedParameterError", "UnsupportedTorchFunction", "TraceError", "ParallelizeError", "SearchCliError", "SearchInputError", "WireError", "CheckpointShapeError", "DataLoaderError", "DataLoaderConfigError", "data", "optim", "parallel", "save", "load", "export", "load_pretrained", "CheckpointKeyError", "autocast", "auto", "memory", "memory_stats",
]
