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
    """An op whose torch kernel requires one dtype (matmul, linear, conv2d, ...) got several."""


class BoxingError(SbpError, ValueError):
    """A requested redistribution cannot be carried out."""


class CommError(SbpError, RuntimeError):
    """A collective or point-to-point operation failed."""


class CommAborted(CommError):
    """Another rank failed; this rank's pending communication was abandoned."""


class CommTimeout(CommError):
    """A collective waited longer than the timeout for some ranks."""
