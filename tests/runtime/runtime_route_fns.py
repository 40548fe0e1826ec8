"""Functions that `test_runtime_routing` launches on gloo ranks (imported by name in each rank
process: keep it cheap to import)."""

from __future__ import annotations

import threading

from runtime_gloo_fns import pipeline_fn
from sbpflow.comm import current


def pipeline_threads_fn(schedule: str) -> dict:
    """`pipeline_fn`, plus the names of the rank's live threads afterwards and the message
    bytes it received."""
    out = pipeline_fn(schedule)
    out["received"] = current().stats()["message"].recv
    out["threads"] = sorted(t.name for t in threading.enumerate())
    return out
