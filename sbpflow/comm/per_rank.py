"""One rank's state of the layers above comm, as named fields (`Communicator.per_rank`).

Each field is owned by the module named in its comment; it holds what that module keeps for
this rank between calls (every rank of a world starts from the defaults). Slotted: a field
read on the dispatch path (the seed counter) costs one attribute read, as a dict lookup did.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..utils import IdentityMap


@dataclass(slots=True)
class PerRankState:
    """The per-rank fields of the layers above the communicator."""

    seed: int = 0  # tensor.creation: the seed of this rank's stream of default seeds
    seed_counter: int = 0  # tensor.creation: default seeds drawn so far (graph replays set it)
    retained_grads: IdentityMap = field(default_factory=IdentityMap)  # tensor: retain_grad locals
    boxing_trace: list | None = None  # boxing.record_steps: (phase, BoxingStep) run, or None
    launch_calls: int = 0  # comm.world: launch result channels used (a new name per call)
    graph_plans: int = 0  # graph.compiled: graph plans built on this rank (same on every rank)
    # graph.nn_graph: timeline messages that came for a later call, by its tag
    graph_timeline_early: dict = field(default_factory=dict)
    # gradsync.GradSync.OWNERS: parameter -> the GradSync acting for it
    grad_sync_owners: IdentityMap = field(default_factory=IdentityMap)
    # zero.shard_sync.ShardSync.OWNERS: parameter -> the ShardSync acting for it
    zero_sync_owners: IdentityMap = field(default_factory=IdentityMap)
    stale_wholes: IdentityMap = field(default_factory=IdentityMap)  # param_state: mark_stale
    pending_gathers: IdentityMap = field(default_factory=IdentityMap)  # zero.pending: futures
    zero_units: object | None = None  # zero.gather: the unit calls (_UnitCalls), made on use
    zero_pending: list = field(default_factory=list)  # zero.gather: (params, reduce future)
    zero_workers: dict = field(default_factory=dict)  # zero.worker: stream name -> _Worker
    optim_boxed_grads: IdentityMap = field(default_factory=IdentityMap)  # optim.boxed_grads
    pending_mean_streams: dict = field(default_factory=dict)  # nn.eager_count_mean: key -> stream
    cdp_trainers: int = 0  # parallel.cdp.trainer: trainers built on this rank (their ids)
