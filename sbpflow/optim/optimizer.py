"""The optimizer base: torch's ``param_groups`` / ``state`` / ``state_dict`` API on global
parameters.

Before a parameter's update its gradient — laid out as ``dual(sbp)`` — is boxed to the
parameter's own layout: for a replicated (``B``) parameter that is the all-reduce of data
parallelism (``P -> B``), for a split one nothing or the reduce-scatter of ZeRO (``P -> S``). The
update then runs on the local shards under ``torch.no_grad``; it is elementwise, so the same
code serves every layout. Optimizer state (``exp_avg``, ``momentum_buffer``, ...) is held as
global tensors in the parameter's layout: each rank keeps only its shard.

`Optimizer` subclasses ``torch.optim.Optimizer`` (without its constructor) so torch's
learning-rate schedulers, which check ``isinstance(opt, torch.optim.Optimizer)`` and only read
and write ``param_groups``, work unchanged (``sf.optim.lr_scheduler`` is torch's module).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterator

import torch

from .. import comm as _comm
from ..errors import CheckpointError, OptimizerStateError, SbpError, ShapeError
from ..gradsync import GradSync, zero_grads
from ..param_state import (backfill, has_backfills, has_update_layouts, mark_stepped,
                           replaced_by, replaced_version, update_layout)
from ..sbp import format_nd_sbp
from ..tensor import GlobalTensor, tensor as _sf_tensor
from ..zero import layout as _zero
from ..zero import worker as _zero_worker
from ..zero.pending import set_pending, settle
from ..zero.shard_sync import ShardSync
from .boxed_grads import (_BUCKET_BYTES, _SHARD_BUCKET, _boxed_cache, _forget, _has_partial,
                          boxed_grad, boxed_grads)
from .clip import clip_groups
from .state_layout import cast_like, conform

__all__ = ["Optimizer", "OptimizerStateError", "boxed_grad", "boxed_grads", "state_like"]

def _same(a: list, b: list) -> bool:
    """Whether two parameter lists hold the same objects in the same order (``==`` on lists
    compares differing parameters with `GlobalTensor.__eq__`, an elementwise op)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _idle(params: list, rank: int) -> set:
    """The ids of ``params`` that ``rank`` holds no shard of and whose update layout is their
    own (no ZeRO split): their gradient there is the empty shard, which `boxed_grads` would
    only relabel and the update would not touch."""
    if not has_update_layouts() and not has_backfills():   # no ZeRO split anywhere
        return {id(p) for p in params if rank not in p.placement}
    return {id(p) for p in params if rank not in p.placement and update_layout(p) == p.sbp
            and backfill(p) is None}


def _held_here(params: list, rank: int) -> bool:
    """Whether every parameter lives on ``rank`` alone (a placement of one device holding it)
    and no parameter anywhere has a ZeRO layout: then each gradient is already in its update
    layout, with nothing to box, bucket or collect."""
    if has_update_layouts() or has_backfills():
        return False
    for p in params:
        pl = p.placement
        if pl.size != 1 or rank not in pl:
            return False
    return True


def state_like(p: GlobalTensor, fill: float = 0.0) -> GlobalTensor:
    """A state tensor for ``p``: same shape, dtype and layout, filled with ``fill`` on every
    shard (meant for elementwise state; no communication). The update sees a ZeRO stage-1
    parameter in its split update layout, so its state is split too."""
    local = torch.full_like(p.local, fill).detach()
    return GlobalTensor(local, tuple(p.shape), p.placement, p.sbp)


class Optimizer(torch.optim.Optimizer):
    """Base class: ``param_groups`` (list of dicts with ``"params"`` and hyper-parameters),
    ``state`` (per parameter), ``zero_grad``, ``state_dict`` / ``load_state_dict``, ``step``.

    A subclass sets ``linear_update`` (whether its update may run on partial-sum shards) and
    implements ``_update(p, grad_local, state, group)``, which runs on local shards under
    ``torch.no_grad`` with ``grad_local`` already in ``p``'s layout; or, to update a group's
    parameters together (multi-tensor kernels), ``_update_group(params, grads, states, group)``
    with lists of the parameters that have a gradient, their local gradients and states."""

    linear_update = False
    # start the all-reduces of data-parallel gradients during backward (from the second step
    # on: the first step sets up the buckets); `no_sync` for accumulated micro-batches
    overlap_grad_sync = True
    grad_bucket_bytes = _BUCKET_BYTES
    # None: 1 MiB on CUDA (the first all-reduce starts early), bucket size on a CPU (gradsync)
    first_grad_bucket_bytes: int | None = None

    def __init__(self, params, defaults: dict) -> None:  # noqa: D401 - not torch's __init__
        self.defaults = dict(defaults)
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        if isinstance(params, GlobalTensor):
            raise TypeError("params should be an iterable of global tensors or dicts, got a "
                            "single GlobalTensor")
        self.state: defaultdict = defaultdict(dict)
        self.param_groups: list[dict] = []
        self._sync: GradSync | None = None
        self._shard_sync: ShardSync | None = None
        self._sync_params: list = []
        self._checked: tuple = (0, [])   # (replaced_version(), params) last found current
        self._stepped = False   # params marked stepped (`sf.parallel.zero.shard` refuses them)
        groups = list(params)
        if not groups:
            raise ValueError("optimizer got an empty parameter list")
        if not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        for g in groups:
            self.add_param_group(g)

    def add_param_group(self, param_group: dict) -> None:
        group = dict(param_group)
        params = group["params"]
        params = [params] if isinstance(params, GlobalTensor) else list(params)
        for p in params:
            if not isinstance(p, GlobalTensor):
                raise TypeError(f"{type(self).__name__} optimizes sf.GlobalTensor parameters, "
                                f"got {type(p).__name__}")
            if not p.is_leaf:
                raise ValueError(f"can't optimize a non-leaf tensor (shape {tuple(p.shape)}, "
                                 f"placement {p.placement}, sbp {format_nd_sbp(p.sbp)})")
        if len({id(p) for p in params}) != len(params):
            raise ValueError("optimizer parameter group contains duplicate parameters")
        seen = {id(p) for g in self.param_groups for p in g["params"]}
        if any(id(p) in seen for p in params):
            raise ValueError("some parameters appear in more than one parameter group")
        group["params"] = params
        for k, v in self.defaults.items():
            if v is _REQUIRED and k not in group:
                raise ValueError(f"parameter group didn't specify a value of required "
                                 f"optimization parameter {k}")
            group.setdefault(k, v)
        self.param_groups.append(group)
        self._stepped = False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside start no gradient all-reduce: for all micro-batches but the
        last when accumulating (as DDP's ``no_sync``). Without it each backward's all-reduces
        are redone by the next, so accumulation stays correct but communicates k times."""
        with contextlib.ExitStack() as stack:
            for sync in (self._sync, self._shard_sync):
                if sync is not None:
                    stack.enter_context(sync.no_sync())
            yield

    def zero_grad(self, set_to_none: bool = True) -> None:
        params = [p for g in self.param_groups for p in g["params"]]
        zero_grads(params, set_to_none)
        if _boxed_cache():
            for p in params:
                _forget(p)

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__} ("]
        for i, g in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            lines += [f"    {k}: {v}" for k, v in sorted(g.items()) if k != "params"]
        return "\n".join(lines) + "\n)"

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        """One update of every parameter that has a gradient (every rank must call it: the
        gradients' boxing is a collective, in ``param_groups`` order). A parameter group with
        ``clip_grad_max_norm`` (and ``clip_grad_norm_type``, default 2) has its gradients
        clipped to that joint norm first (`clip.clip_groups`, as OneFlow's)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        params = [p for group in self.param_groups for p in group["params"]]
        version = replaced_version()
        if version and (version != self._checked[0] or not _same(params, self._checked[1])):
            self._refuse_replaced(params)
            self._checked = (version, params)
        settle(params)   # ZeRO-1 gathers of the last step not waited for by a forward
        if not self._stepped:
            mark_stepped(params)
            self._stepped = True
        if any("clip_grad_max_norm" in g for g in self.param_groups):
            clip_groups(self.param_groups)
        if not self.linear_update:
            self._refuse_partial(params)
        if self.overlap_grad_sync and not _same(self._sync_params, params):
            self._sync = GradSync(params, self.grad_bucket_bytes, self.first_grad_bucket_bytes)
            self._shard_sync = ShardSync(params, min(self.grad_bucket_bytes, _SHARD_BUCKET))
            self._sync_params = params
        if _held_here(params, _comm.rank()):
            # each local gradient is already the boxed one (a partial sum of one rank is the
            # value): nothing to reduce, collect or bucket
            grads = iter([None if p.local.grad is None else
                          GlobalTensor(p.local.grad, tuple(p.shape), p.placement, p.sbp)
                          for p in params])
            for group in self.param_groups:
                self._step_group(group, grads, (), [])
        else:
            self._step_boxed(params)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    def _step_boxed(self, params: list) -> None:
        """The update of ``params`` (every group's) from their gradients boxed to their update
        layouts (`boxed_grads`: the all-reduces, ZeRO's reduce-scatters), then ZeRO's
        all-gathers started in the background."""
        # parameters of other ranks (a pipeline's other stages): only their state's bookkeeping
        idle = _idle(params, _comm.rank())
        grads = iter(boxed_grads([p for p in params if id(p) not in idle] if idle else params,
                                 consume=True))
        gather = []   # ZeRO 1 and 2: (parameter, whole local, geometry) to fill after the update
        for group in self.param_groups:
            self._step_group(group, grads, idle, gather)
        if gather:   # in the background: the next forward's units wait for their own
            for chunk in _zero.chunks(gather, _SHARD_BUCKET):
                fut = _zero_worker.submit(_zero.all_gather_into, [it[1:] for it in chunk])
                for it in chunk:
                    set_pending(it[0], fut)

    def _step_group(self, group: dict, grads: Iterator, idle: set, gather: list) -> None:
        """Update ``group``'s parameters from their boxed gradients ``grads`` (an iterator
        over the parameters not in ``idle``, in order); those in ``idle`` (ids) with a gradient
        get `_idle_group`; ZeRO's all-gathers to make after are added to ``gather``."""
        cache = _boxed_cache()
        cache = cache if cache else None
        fills = has_backfills()   # (none: no lookup a parameter)
        state = self.state
        ps, gs, sts, rest, rest_sts = [], [], [], [], []
        for p in group["params"]:
            if idle and id(p) in idle:
                if p.shard.grad is not None:
                    rest.append(p)
                    rest_sts.append(state[p])
                    if rest_sts[-1]:
                        conform(rest_sts[-1], p.placement, p.sbp, p.shard.dtype)
                continue
            g = next(grads)
            if g is None:
                continue
            if cache is not None:
                cache.pop(p, None)
            st = state[p]
            if st:   # state made before its layout was known (a load, then ZeRO): moved
                conform(st, p.placement, g.sbp, p.shard.dtype)
            sts.append(st)
            fill = backfill(p) if fills else None
            if fill is not None:
                whole, compute, split = fill
                geo = _zero.geometry(tuple(p.shape), p.placement, compute, split, _comm.rank())
                if geo is not None:
                    gather.append((p, whole, geo))
            if g.sbp != p.sbp:   # stage 1: update the split shard in place
                p = _zero.shard_view(p, g.sbp)
            ps.append(p)
            gs.append(g.local)
        if ps:
            self._update_group(ps, gs, sts, group)
        if rest:
            self._idle_group(rest, rest_sts, group)

    def _idle_group(self, params: list, states: list, group: dict) -> None:
        """A step of parameters this rank holds no shard of (their gradient is the empty
        shard): no element to update, only the state's bookkeeping, so that every rank keeps
        the same state entries (a state dict's collectives pair up). By default the update
        itself, on the empty shards; a subclass may do just the bookkeeping."""
        self._update_group(params, [p.shard.grad for p in params], states, group)

    def _refuse_replaced(self, params: list) -> None:
        """`OptimizerStateError` naming the first of ``params`` that `mark_replaced` marked."""
        for p in params:
            hit = replaced_by(p)
            if hit is not None:
                name, who = hit
                raise OptimizerStateError(
                    f"{type(self).__name__}: parameter {name!r} (shape {tuple(p.shape)}, "
                    f"placement {p.placement}, sbp {format_nd_sbp(p.sbp)}) is no longer the "
                    f"model's: {who} replaced it by a new parameter object, so this step "
                    f"would change nothing. Build the optimizer after {who} (it replaces the "
                    f"parameters): opt = sf.optim.AdamW(model.parameters(), ...)")

    def _refuse_partial(self, params: list) -> None:
        """SbpError for a parameter with a gradient laid out as partial sums (a non-linear
        update cannot run shard by shard)."""
        if not any(map(_has_partial, [p.sbp for p in params])):
            return
        for p in params:
            if _has_partial(p.sbp) and p.local.grad is not None:
                raise SbpError(
                    f"{type(self).__name__}: its update is not linear, so a parameter laid "
                    f"out as partial sums cannot be updated shard by shard (shape "
                    f"{tuple(p.shape)}, placement {p.placement}, sbp "
                    f"{format_nd_sbp(p.sbp)}); lay it out with B or S")

    def _update(self, p: GlobalTensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        raise NotImplementedError

    def _update_group(self, params: list, grads: list, states: list, group: dict) -> None:
        """Update ``params`` (those of ``group`` with a gradient) from their local gradients;
        by default one `_update` each."""
        for p, g, st in zip(params, grads, states):
            self._update(p, g, st, group)

    # -- state dicts -----------------------------------------------------------------------------
    def _indexed(self):
        i = 0
        for g in self.param_groups:
            for p in g["params"]:
                yield i, p
                i += 1

    def state_dict(self, *, keep_global: bool = False) -> dict:
        """torch's layout: ``{"state": {index: {...}}, "param_groups": [{..., "params":
        [index, ...]}]}``, plus ``"class"``: the optimizer's class name (torch ignores it; it
        keeps `load_state_dict` from loading one optimizer's state into another). Tensor
        state as logical torch tensors (a collective: every rank must call it), or with
        ``keep_global=True`` as the global tensors themselves. ``"step"`` entries are 0-d
        float tensors, as torch's Adam keeps them."""
        groups, start = [], 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(start, start + len(g["params"])))
            start += len(g["params"])
            groups.append(packed)
        state = {}
        for i, p in self._indexed():
            if p not in self.state or not self.state[p]:
                continue
            entry = {}
            for k, v in self.state[p].items():
                if isinstance(v, GlobalTensor):
                    entry[k] = v if keep_global else v.full_tensor().detach().clone()
                elif k == "step":
                    entry[k] = torch.tensor(float(v))
                else:
                    entry[k] = v
            state[i] = entry
        return {"state": state, "param_groups": groups, "class": type(self).__name__}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer's shape: from `state_dict` (logical torch tensors
        or global tensors) or from a torch optimizer of the same class on the torch twin.
        Each rank keeps the shard of its parameters' update layouts; floating-point state
        is cast to its parameter's dtype (``"step"`` aside), as torch does. A state dict
        that names another optimizer class (``"class"``, as `state_dict` writes) raises
        `CheckpointError`; torch's state dicts name none and are taken as of this class. A
        layout that changes after the load (ZeRO applied later) moves the state at the next
        step (`sbpflow.optim.state_layout.conform`)."""
        saved_class = state_dict.get("class")
        if saved_class is not None and saved_class != type(self).__name__:
            raise CheckpointError(
                f"the state dict holds the state of a {saved_class} optimizer, which cannot be "
                f"loaded into a {type(self).__name__}; build a {saved_class} to load it")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise OptimizerStateError(f"loaded state dict has {len(groups)} parameter groups, "
                                      f"the optimizer {len(self.param_groups)}")
        for i, (g, ng) in enumerate(zip(self.param_groups, groups)):
            if len(g["params"]) != len(ng["params"]):
                raise OptimizerStateError(
                    f"parameter group {i}: the loaded state dict has {len(ng['params'])} "
                    f"parameters, the optimizer {len(g['params'])}")
        index = {}
        for g, ng in zip(self.param_groups, groups):
            index.update(zip(ng["params"], g["params"]))
        new_state: defaultdict = defaultdict(dict)
        saved = state_dict["state"]
        for i, entry in saved.items():
            if i not in index:
                raise OptimizerStateError(f"state for parameter index {i}, which no group has")
            p = index[i]
            new_state[p] = {k: self._load_value(p, k, v) for k, v in entry.items()}
        for g, ng in zip(self.param_groups, groups):
            for k, v in ng.items():
                if k != "params":
                    g[k] = v
        self.state = new_state

    @staticmethod
    def _load_value(p: GlobalTensor, key: str, v: Any) -> Any:
        if key == "step":
            return int(v.item()) if isinstance(v, torch.Tensor) else int(v)
        lay = update_layout(p)
        if lay != p.sbp:     # ZeRO stage 1: the state lives in the split update layout
            p = _zero.shard_view(p, lay)
        if isinstance(v, GlobalTensor):
            if tuple(v.shape) != tuple(p.shape):
                raise ShapeError(f"optimizer state {key!r} has shape {tuple(v.shape)}, its "
                                 f"parameter {tuple(p.shape)} (placement {p.placement}, sbp "
                                 f"{format_nd_sbp(p.sbp)})")
            g = v.detach().to_global(p.placement, p.sbp)
            local = cast_like(g.local, p.dtype)
            local = local.clone() if local is g.local else local
            return GlobalTensor(local, tuple(p.shape), p.placement, p.sbp)
        if isinstance(v, torch.Tensor):
            if tuple(v.shape) != tuple(p.shape):
                raise ShapeError(f"optimizer state {key!r} has shape {tuple(v.shape)}, its "
                                 f"parameter {tuple(p.shape)} (placement {p.placement}, sbp "
                                 f"{format_nd_sbp(p.sbp)})")
            return _sf_tensor(cast_like(v.detach(), p.dtype), p.placement, p.sbp)
        return v


class _Required:
    def __repr__(self) -> str:
        return "<required parameter>"


_REQUIRED = _Required()
