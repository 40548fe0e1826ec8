"""Errors raised by sbpflow. Every user-facing error is an `SbpError`."""

from __future__ import annotations


class SbpError(Exception):
    """Base class of every sbpflow error."""


class SbpParseError(SbpError, ValueError):
    """An sbp or nd-sbp could not be understood (unknown string, wrong type, wrong length)."""


class SplitAxisError(SbpError, ValueError):
    """A split axis is out of range for the tensor's number of dimensions."""


class PlacementError(SbpError, ValueError):
    """A placement is malformed (duplicate or out-of-world ranks, ragged mesh, bad device)."""


class PlacementMismatchError(SbpError, ValueError):
    """Tensors that must share a placement do not."""


class ShapeError(SbpError, ValueError):
    """Shapes disagree (local shards, logical shape, op inputs)."""


class IndexOutOfRange(SbpError, IndexError):
    """An index (embedding id, class target, integer subscript) lies outside the axis it
    indexes: torch's ``IndexError``, raised in every layout (split tables and classes too)."""


class SignatureError(SbpError, ValueError):
    """No valid signature, or a forced signature that is not valid for the inputs."""


class DtypeMismatchError(SbpError, RuntimeError):
    """An op whose torch kernel requires one dtype (matmul, linear, conv2d, ...) got several, or
    an input of a dtype torch refuses there (float class targets, integer random values)."""


class BoxingError(SbpError, ValueError):
    """A requested redistribution cannot be carried out."""


class CommError(SbpError, RuntimeError):
    """A collective or point-to-point operation failed. ``culprits``: the ranks it names as
    the cause (they did not arrive, or wait for no other rank while the others wait for
    them), from what the ranks were doing; empty when it names none (say a connection a
    peer's exit closed: a consequence). A launcher prefers an error that names culprits."""

    culprits: tuple = ()


class CommAborted(CommError):
    """Another rank failed; this rank's pending communication was abandoned."""


class WireError(CommError):
    """A message channel frame or connection that does not parse or does not authenticate, or
    a message that cannot be sent (not plain data and tensors)."""


class CommTimeout(CommError):
    """A collective waited longer than the timeout for some ranks."""


# -- errors of the layers above (defined here, so every error class lives in one place) ---------
class AdvancedIndexError(SbpError, NotImplementedError):
    """A global tensor was indexed with a tensor, a list or a bool (advanced indexing), which
    sbpflow does not support: only int, slice, None and Ellipsis."""


class CostError(SbpError, ValueError):
    """A cost-model request that cannot be answered (bad cluster, unknown kind, rank outside)."""


class StateDictError(SbpError, RuntimeError):
    """A state dict does not fit a module (missing or unexpected keys)."""


class CheckpointError(SbpError, RuntimeError):
    """A checkpoint directory is missing, incomplete, damaged, mixed, or does not fit the
    model or optimizer it is loaded into."""


class CheckpointShapeError(CheckpointError, ShapeError):
    """A tensor of a checkpoint has another logical shape than the model's (or its
    parameter's, for optimizer state): a `CheckpointError` (a checkpoint that does not fit)
    and a `ShapeError` (shapes disagree), so either ``except`` catches it."""


class CheckpointKeyError(CheckpointError, StateDictError):
    """A checkpoint's tensor names do not fit the model's (a tensor the model has that the
    checkpoint lacks, or one the checkpoint has that the model lacks): a `CheckpointError`
    and a `StateDictError`, so either ``except`` catches it."""


class OptimizerStateError(SbpError, ValueError):
    """An optimizer state dict does not fit the optimizer (groups, parameters, shapes)."""


class UnmatchedParameterError(SbpError, ValueError):
    """Some parameters match no rule (and there is no ``"*"`` fallback)."""


class TraceError(SbpError, RuntimeError):
    """The model cannot be traced (no parameters, no traced layers, or its forward fails on
    shapes only)."""


class ParallelizeError(SbpError, ValueError):
    """A strategy cannot be applied to the model (wrong layer count, a device count that does
    not match, a parameter shared by layers that lay it out differently)."""


class SearchCliError(SbpError, ValueError):
    """Bad input to ``sbpflow search`` (unknown model, bad sizes, unusable cluster)."""


class SearchInputError(SbpError, ValueError):
    """Bad input to the strategy search (``sf.auto.search``, ``sbpflow search``) or to a preset
    graph (``sf.auto.model_graphs``): a size below 1, heads that do not divide the width, an
    unknown algorithm or schedule, a budget or micro-batch count out of range. The message
    names the argument, its value and the fix."""


class DataLoaderError(SbpError, RuntimeError):
    """``sf.data.DataLoader`` could not make a batch: reading a sample failed (the message names
    the sample index, batch, epoch and rank), samples that cannot be batched, or the loading
    thread took longer than the timeout."""


class DataLoaderConfigError(SbpError, ValueError):
    """Bad arguments to ``sf.data.DataLoader`` (batch size, prefetch, a partial layout, a
    dataset that is not map-style)."""


class PlanError(SbpError, ValueError):
    """An actor plan is inconsistent (unknown kind, duplicate actor, an input naming no actor
    or register, a slot count below 1, producers and consumers firing different numbers of
    times a run)."""


class GraphError(SbpError, ValueError):
    """``sf.nn.Graph`` cannot compile or run a step: ``build`` used a value it cannot replay
    (computed outside sbpflow's ops), placements that cannot be cut into stages, inputs that
    cannot be split into micro-batches, a bad config value."""


class UnsupportedTorchFunction(SbpError, NotImplementedError):
    """A torch function or Tensor method that sbpflow does not run on global tensors (the
    message names it and what to use instead)."""


class ActorAborted(CommAborted):
    """An actor on another rank failed (or timed out): this rank's runtime stopped. The message
    names that rank, that actor and its exception."""


class ActorTimeout(CommTimeout):
    """An actor could not fire for longer than ``SBPFLOW_TIMEOUT`` seconds: the message names
    it and the register it waits for (an input's req, a free output slot, or a consumer's
    ack)."""
