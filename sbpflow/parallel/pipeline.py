"""``sf.parallel.pipeline``: lay a model out stage by stage over placements and insert the
stage-boundary moves, without touching the model's code (issue 14, part 2, eager mode)::

    sf.parallel.pipeline(model, [pl0, pl1, pl2, pl3], split=["blocks.2", "blocks.4", "blocks.6"])

Stage 0 starts at the model, stage i at module ``split[i-1]``, in ``model.named_modules()``
order. Stage i's parameters and buffers go to ``placements[i]`` (``rules[i]`` as in
`sf.parallel.apply`; default replicated). Forward pre-hooks move, on entering stage i, the
global-tensor arguments of its first module and the model's own global-tensor inputs (so
``pos`` or ``targets`` reach the stage that reads them) to ``placements[i]``; the model's
``forward`` is wrapped so that its inputs get their own layouts back however the call ends. A
parameter used by several stages (tied) keeps a copy in each (`sbpflow.parallel.tie`).
Placements may not share ranks. Eager mode runs the stages one after another (serial);
graph mode pipelines micro-batches. See docs/runtime.md, 'Pipeline stages'.
"""

from __future__ import annotations

import bisect
import difflib
from typing import Mapping, Sequence

import torch

from .. import comm as _comm
from ..errors import ParallelizeError, SbpError
from ..nn.modules import Module, Parameter, RemovableHandle
from ..placement import Placement
from ..sbp import B, format_nd_sbp, parse_nd_sbp
from ..tensor import GlobalTensor, set_recorder
from .apply import match_rules
from .relayout import relayout
from .tie import install_views as _install_views, tie_placement as _tie_placement

__all__ = ["pipeline", "pipeline_of", "Pipeline"]

_WHO = "sf.parallel.pipeline"


class Pipeline:
    """What `pipeline` did to a model: ``placements`` and ``split`` (one stage each, the split
    points), ``module_stage`` (every module name of ``named_modules(remove_duplicate=False)`` ->
    its stage) and the stage hooks; ``stage_of(name)`` for a module or parameter name.
    ``remove()`` takes the hooks and the model's ``forward`` wrapper off (parameters and buffers
    stay where they are)."""

    def __init__(self, placements: tuple, split: tuple, module_stage: dict, sbp: tuple) -> None:
        self.placements, self.split, self.module_stage = placements, split, module_stage
        self.sbp = sbp
        self.rules: list = [None] * len(placements)   # per stage, for modules moved (`rehome`)
        self.handles: list[RemovableHandle] = []
        self._frames: list[list] = []   # per model call in progress: its routed inputs
        self._stages: list[int] = []    # per model call in progress: the stage running now
        self._placing: list[RemovableHandle] = []   # the `run_here` hooks, until settled
        self._ran: dict = {}            # module name -> the stage it ran in (first call)
        self._unwrap = None             # undoes `_wrap_forward`

    @property
    def num_stages(self) -> int:
        """The number of stages (placements)."""
        return len(self.placements)

    def stage_of(self, name: str) -> int:
        """The stage of a module (``"blocks.2"``) or parameter / buffer (``"blocks.2.ln1.weight"``)
        name."""
        if name in self.module_stage:
            return self.module_stage[name]
        owner = name.rpartition(".")[0]
        if owner in self.module_stage:
            return self.module_stage[owner]
        raise KeyError(f"{_WHO}: {name!r} names no module or parameter of the model")

    def remove(self) -> None:
        """Take the stage hooks and the model's forward wrapper off."""
        for h in self.handles + self._placing:
            h.remove()
        self.handles.clear()
        self._placing.clear()
        if self._unwrap is not None:
            self._unwrap()
            self._unwrap = None

    def __repr__(self) -> str:
        starts = ["(model)"] + list(self.split)
        body = ", ".join(f"{s}@{p}" for s, p in zip(starts, self.placements))
        return f"Pipeline({body})"

    # -- the moves ---------------------------------------------------------------------------
    def layout_entering(self, t: GlobalTensor, stage: int) -> tuple:
        """The nd-sbp ``t`` takes on entering ``stage``: ``sbp[stage]`` (an nd-sbp, or a
        function of the tensor), else its own nd-sbp on a mesh of the same ndim, else
        replicated."""
        spec, pl = self.sbp[stage], self.placements[stage]
        if spec is None:
            return t.sbp if t.placement.ndim == pl.ndim else (B,) * pl.ndim
        return spec(t) if callable(spec) else spec

    def move(self, t: GlobalTensor, stage: int, what: str) -> GlobalTensor:
        """``t`` on ``placements[stage]`` (itself when already there; a differentiable boxing
        otherwise). An `SbpError` names the stage and the tensor."""
        pl = self.placements[stage]
        if t.placement is pl or t.placement == pl:
            return t
        try:
            return t.to_global(pl, self.layout_entering(t, stage))
        except SbpError as exc:
            raise type(exc)(f"{_WHO}: moving {what} (shape {tuple(t.shape)}, {t.placement}, "
                            f"sbp {format_nd_sbp(t.sbp)}) into stage {stage} on {pl}: "
                            f"{exc}") from None

    def enter_model(self, frame: list, args: tuple, kwargs: dict) -> None:
        """Fill ``frame`` (already on ``_frames``): remember the model's global-tensor inputs
        (restored by `leave_model`) as given (their home, from which each stage's copy is
        moved) and put each on stage 0. Moving from where the caller put an input, not from
        stage 0, keeps targets given on the last stage (as torch's pipelining takes them)
        there: a graph then drops the copies nothing reads, and no value goes back a stage."""
        for t in _global_inputs(args, kwargs):
            saved = _fields(t)
            home = _snapshot(t)
            frame.append((t, saved, home))
            _set_fields(t, _fields(self.move(home, 0, "a model input")))

    def leave_model(self, frame: list) -> None:
        """Take ``frame`` off ``_frames`` and give its inputs back their own layouts."""
        for k in range(len(self._frames) - 1, -1, -1):
            if self._frames[k] is frame:
                del self._frames[k]
                break
        for t, saved, _ in reversed(frame):
            _set_fields(t, saved)

    def call_model(self, forward, args: tuple, kwargs: dict):
        """``forward(*args, **kwargs)`` with the inputs routed; they get their own layouts back
        however it ends -- also on a BaseException (KeyboardInterrupt), which a forward hook
        with ``always_call`` would not see (it runs on Exception only, as torch's)."""
        frame: list = []
        self._frames.append(frame)
        self._stages.append(0)
        try:
            self.enter_model(frame, args, kwargs)
            out = forward(*args, **kwargs)
            self.settle()
            return out
        finally:
            self._stages.pop()
            self.leave_model(frame)

    def enter_stage(self, stage: int, args: tuple, kwargs: dict) -> tuple:
        """Pre-hook of stage ``stage``'s first module: the model's inputs follow (rebound in
        place, so the model's own references see them there) and the module's global-tensor
        arguments are moved; returns the new ``(args, kwargs)``."""
        if self._frames:
            self._stages[-1] = stage
            for t, _, home in self._frames[-1]:
                _set_fields(t, _fields(self.move(home, stage, "a model input")))
        new_args = tuple(self._arg(a, stage, f"argument {i}") for i, a in enumerate(args))
        new_kwargs = {k: self._arg(v, stage, f"argument {k!r}") for k, v in kwargs.items()}
        return new_args, new_kwargs

    def settle(self) -> None:
        """After the first model call every module is where it runs: the `run_here` hooks go."""
        for h in self._placing:
            h.remove()
        self._placing.clear()

    def run_here(self, name: str, module: Module) -> None:
        """Pre-hook of every module holding parameters or buffers of its own: a module that
        runs in another stage than the one its place in ``named_modules()`` gave it (Llama's
        ``rotary_emb``, registered after the layers and called before them; OPT's
        ``final_layer_norm``, registered before the layers and called after them) moves to
        the stage running it, during the first model call (`rehome`); the hooks go after it
        (`settle`)."""
        if not self._stages:
            return                       # called outside the model's forward
        stage = self._stages[-1]
        ran = self._ran.setdefault(name, stage)
        if ran != stage:
            raise ParallelizeError(f"{_WHO}: module {name!r} ran in stages {ran} and {stage}; "
                                   f"a module lives on one stage (move the split points so "
                                   f"that its calls share a stage)")
        if self.module_stage[name] != stage:
            self.rehome(name, module, stage)

    def rehome(self, name: str, module: Module, stage: int) -> None:
        """Move ``module``'s own parameters (in place: the same objects, laid out by
        ``rules[stage]``) and buffers onto ``placements[stage]``; a collective of the ranks
        of both stages, outside any graph's trace and autograd (before the first step: an
        optimizer built after `pipeline` holds the same objects). `ParallelizeError` for a
        weight tied across stages."""
        old = self.module_stage[name]
        own = [(k, p) for k, p in module._parameters.items() if p is not None]
        if any(p.placement != self.placements[old] for _, p in own):   # on the tie placement
            raise ParallelizeError(f"{_WHO}: module {name!r} holds a weight tied across "
                                   f"stages and ran in stage {stage}: split elsewhere")
        full = {f"{name}.{k}" if name else k: p for k, p in own}
        pl = self.placements[stage]
        rule = self.rules[stage] or {"*": (B,) * pl.ndim}
        layouts = match_rules(list(full), rule, pl, module, name) if full else {}
        previous = set_recorder(None)
        try:
            with torch.no_grad():
                for key, p in full.items():
                    moved = p.to_global(pl, layouts[key])
                    local = moved.local.detach().clone().requires_grad_(p.requires_grad)
                    _set_fields(p, (local, pl, moved.sbp, moved._key))
                for key, b in list(module._buffers.items()):
                    if b is not None:
                        module._buffers[key] = self.move(b, stage, f"buffer {name}.{key}")
        finally:
            set_recorder(previous)
        self.module_stage[name] = stage

    def _arg(self, a, stage: int, what: str):
        """``a`` with its global tensors moved, inside tuples, lists and dicts too (Llama's
        layers take ``position_embeddings=(cos, sin)``)."""
        if isinstance(a, GlobalTensor):
            return self.move(a, stage, f"{what} of {self._first(stage)!r}")
        if type(a) in (tuple, list):
            return type(a)(self._arg(v, stage, f"{what}[{i}]") for i, v in enumerate(a))
        if type(a) is dict:
            return {k: self._arg(v, stage, f"{what}[{k!r}]") for k, v in a.items()}
        return a

    def _first(self, stage: int) -> str:
        return self.split[stage - 1] if stage else "(model)"


# -- in-place rebinding of the model's inputs ------------------------------------------------------
# The model's forward holds its inputs by reference (``targets`` is read after the last stage's
# modules), so an input follows the stages by taking, in place, the fields of its copy on the
# current stage -- as torch's ``.data =`` swaps a tensor's storage. Autograd is untouched: each
# copy's shard hangs off the home shard through the boxing, so gradients flow back to it.
def _fields(t: GlobalTensor) -> tuple:
    return t._local, t._placement, t._sbp, t._key


def _set_fields(t: GlobalTensor, fields: tuple) -> None:
    t._local, t._placement, t._sbp, t._key = fields


def _snapshot(t: GlobalTensor) -> GlobalTensor:
    """A new wrapper of ``t``'s current shard and layout (unaffected by rebinding ``t``)."""
    return GlobalTensor(t.local, tuple(t.shape), t.placement, t.sbp)


def _global_inputs(args: tuple, kwargs: dict) -> list[GlobalTensor]:
    """The distinct global tensors among the top-level arguments (parameters excluded: they
    belong to a stage)."""
    out, seen = [], set()
    for a in (*args, *kwargs.values()):
        if isinstance(a, GlobalTensor) and not isinstance(a, Parameter) and id(a) not in seen:
            seen.add(id(a))
            out.append(a)
    return out


# -- checks ------------------------------------------------------------------------------------------
def _check_placements(placements, split) -> tuple:
    if isinstance(placements, Placement) or not isinstance(placements, Sequence):
        raise ParallelizeError(f"{_WHO}: placements must be a list of sf.placement, one a stage, "
                               f"got {placements!r}")
    if isinstance(split, str) or not isinstance(split, Sequence) \
            or not all(isinstance(s, str) for s in split):
        raise ParallelizeError(f"{_WHO}: split must be a list of module names, got {split!r}")
    if len(placements) != len(split) + 1:
        raise ParallelizeError(
            f"{_WHO}: {len(split)} split point(s) {list(split)} make {len(split) + 1} stage(s) "
            f"but {len(placements)} placement(s) were given: give one placement a stage")
    world = _comm.world_size()
    for i, pl in enumerate(placements):
        if not isinstance(pl, Placement):
            raise ParallelizeError(f"{_WHO}: placement of stage {i} is {pl!r}, not an "
                                   f"sf.placement")
        try:
            pl.check_world(world)
        except SbpError as exc:
            raise type(exc)(f"{_WHO}: placement of stage {i}: {exc}") from None
    for i in range(len(placements)):
        for j in range(i + 1, len(placements)):
            shared = sorted(set(placements[i].flat_ranks) & set(placements[j].flat_ranks))
            if shared:
                raise ParallelizeError(
                    f"{_WHO}: stages {i} ({placements[i]}) and {j} ({placements[j]}) share "
                    f"rank(s) {shared}; a rank may be in one stage only (give each stage its "
                    f"own ranks)")
    return tuple(placements)


def _per_stage(value, n: int, what: str) -> list:
    """``value`` as one entry a stage: None -> Nones; a list must have ``n`` entries."""
    if value is None:
        return [None] * n
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise ParallelizeError(f"{_WHO}: {what} must be a list with one entry a stage ({n}), "
                               f"got {value!r}")
    return list(value)


def _check_sbp_specs(specs: list, placements: tuple) -> tuple:
    out = []
    for i, (spec, pl) in enumerate(zip(specs, placements)):
        if spec is not None and not callable(spec):
            try:
                spec = parse_nd_sbp(spec, pl.ndim)
            except SbpError as exc:
                raise type(exc)(f"{_WHO}: sbp of stage {i} on {pl}: {exc}") from None
        out.append(spec)
    return tuple(out)


def _split_positions(listing: list, split: Sequence[str]) -> list[int]:
    """Each split point's position in ``listing`` (``named_modules(remove_duplicate=False)``),
    checked: a module of the model, not the model itself, used under one name, in order."""
    index = {name: k for k, (name, _) in enumerate(listing)}
    positions = []
    for name in split:
        if name == "":
            raise ParallelizeError(f"{_WHO}: '' (the model itself) cannot be a split point: "
                                   f"stage 0 starts at the model")
        if name not in index:
            near = difflib.get_close_matches(name, [n for n in index if n], n=3)
            raise ParallelizeError(f"{_WHO}: split point {name!r} is not a module of the "
                                   f"model (named_modules()); close names: {near}")
        module = listing[index[name]][1]
        aliases = [n for n, m in listing if m is module]
        if len(aliases) > 1:
            raise ParallelizeError(f"{_WHO}: split point {name!r} is one module under several "
                                   f"names {aliases}: split at a module used once")
        if name in split[:len(positions)]:
            raise ParallelizeError(f"{_WHO}: split point {name!r} is given twice in {list(split)}")
        if positions and index[name] <= positions[-1]:
            raise ParallelizeError(f"{_WHO}: split points must follow the order of "
                                   f"named_modules(): {name!r} does not come after "
                                   f"{split[len(positions) - 1]!r}")
        positions.append(index[name])
    return positions


def _encloses(name: str, inner: str) -> bool:
    """Whether module ``name`` contains module ``inner`` (the model, ``''``, contains all)."""
    return name == "" or inner.startswith(name + ".")


def _holds_tensors(module: Module) -> bool:
    """Whether ``module`` itself (not its children) has a parameter or a buffer."""
    return any(t is not None for key in ("_parameters", "_buffers")
               for t in module.__dict__[key].values())


def _later_module(listing: list, at: int) -> str | None:
    """The first module after ``listing[at]`` that is not inside it (a split point there
    keeps ``listing[at]`` and its children in the stage before), or None."""
    name = listing[at][0]
    return next((n for n, _ in listing[at + 1:] if not _encloses(name, n)), None)


def _check_stages_have_work(listing: list, positions: list[int], split: Sequence[str]) -> None:
    """Refuse a split that leaves a stage empty: its modules (``listing[start:end]``) are only
    containers of the next stage's first module (the model itself and ``net`` for a split at
    ``net.0``, the first module of ``net``), holding no parameter or buffer of their own. The
    stage's ranks would do nothing but pass the inputs on. `ParallelizeError` naming the
    split point, the stage and the fix."""
    bounds = [0, *positions]
    for i, nxt in enumerate(positions):
        start, first = bounds[i], split[i]
        own = listing[start:nxt]
        if any(not _encloses(n, first) or _holds_tensors(m) for n, m in own):
            continue
        later = _later_module(listing, nxt)
        fewer = f"use one stage fewer (drop split point {first!r} and a placement)"
        fix = fewer if later is None else (f"split at a later module (such as {later!r}, the "
                                           f"first after {first!r} and its children), or {fewer}")
        raise ParallelizeError(
            f"{_WHO}: split {list(split)} leaves stage {i} empty: its modules "
            f"{[n or '(model)' for n, _ in own]} only contain {first!r}, where stage {i + 1} "
            f"starts, and hold no parameter or buffer, so the ranks of stage {i} would sit "
            f"idle; {fix}")


def _module_stages(model: Module, split: Sequence[str]) -> tuple[dict, list, list]:
    """(module name -> stage, the split modules, the ties). A tie is the list of
    ``(module name, attribute)`` of one parameter reached from modules of several stages (a
    weight tied across stages: each stage holds a copy, `sbpflow.parallel.tie`). A buffer
    reached from two stages is refused: it can live on one placement only."""
    listing = list(model.named_modules(remove_duplicate=False))
    modules = dict(listing)
    positions = _split_positions(listing, split)
    _check_stages_have_work(listing, positions, split)
    stages = {name: bisect.bisect_right(positions, k) for k, (name, _) in enumerate(listing)}
    owners: dict = {}
    for name, m in listing:
        for key in ("_parameters", "_buffers"):
            for pname, t in m.__dict__[key].items():
                if t is not None:
                    owners.setdefault(id(t), (key, []))[1].append((name, pname))
    ties = []
    for key, users in owners.values():
        used = sorted({stages[n] for n, _ in users})
        if len(used) < 2:
            continue
        names = [f"{n}.{a}" if n else a for n, a in users]
        if key == "_buffers":
            raise ParallelizeError(f"{_WHO}: buffers {names} are one tensor used by stages "
                                   f"{used}; a buffer lives on one placement (move the split "
                                   f"points so that its users share a stage)")
        if _shared_module(users, modules, stages):
            # one module object in two stages runs on one placement: its weights' views (a
            # stage's each) cannot follow the call
            raise ParallelizeError(f"{_WHO}: parameters {names} belong to one module called "
                                   f"in stages {used}; a module lives on one stage (move the "
                                   f"split points so that its calls share a stage, or give "
                                   f"each stage its own module, tying only the weights)")
        ties.append(users)
    return stages, [listing[k][1] for k in positions], ties


def _shared_module(users: list, modules: dict, stages: dict) -> bool:
    """Whether one module object among ``users`` ((module name, attribute)) is reached under
    names of different stages."""
    seen: dict = {}
    for name, _ in users:
        seen.setdefault(id(modules[name]), set()).add(stages[name])
    return any(len(v) > 1 for v in seen.values())


# -- the layout -----------------------------------------------------------------------------------
def _param_layouts(model: Module, module_stage: dict, placements: tuple, rules: list,
                   ties: list) -> dict:
    """``{parameter name: (placement, nd-sbp)}``: ``rules[stage]`` by name, else replicated.
    A tied parameter's names in each of its stages (``ties``) are matched by that stage's
    rules, and the parameter goes on the tie placement (`tie.tie_placement`), under each name."""
    def stage_of(name: str) -> int:
        return module_stage[name.rpartition(".")[0]]
    names_by_stage: list[list[str]] = [[] for _ in placements]
    for name, _ in model.named_parameters():
        names_by_stage[stage_of(name)].append(name)
    tie_names = []   # per tie: [(stage, its first name in that stage)], stages in order
    for users in ties:
        per: dict = {}
        for mod, attr in users:
            full = f"{mod}.{attr}" if mod else attr
            per.setdefault(module_stage[mod], full)
        tie_names.append(sorted(per.items()))
        for st, full in per.items():
            if full not in names_by_stage[st]:
                names_by_stage[st].append(full)
    out = {}
    for i, (pl, names) in enumerate(zip(placements, names_by_stage)):
        rule = {"*": (B,) * pl.ndim} if rules[i] is None else rules[i]
        if not isinstance(rule, Mapping):
            raise ParallelizeError(f"{_WHO}: rules of stage {i} must be a dict of name "
                                   f"patterns to nd-sbps (as sf.parallel.apply), got {rule!r}")
        try:
            layouts = match_rules(names, rule, pl, model)   # styles resolve against it
        except SbpError as exc:
            raise type(exc)(f"{_WHO}: stage {i}: {exc}") from None
        out.update({n: (pl, nd) for n, nd in layouts.items()})
    for per in tie_names:
        names = [n for _, n in per]
        tied = _tie_placement(" = ".join(names), [placements[st] for st, _ in per],
                              [out[n][1] for n in names], _WHO)
        out.update({n: tied for n in names})
    return out


def _tie_views(model: Module, pipe: Pipeline, ties: list) -> None:
    """Each stage's users of a tied parameter read it through that stage's view."""
    for users in ties:
        mod, attr = users[0]
        param = model.get_submodule(mod)._parameters[attr]
        pipe.handles += _install_views(param, [
            (model.get_submodule(m), a, pipe.placements[pipe.module_stage[m]])
            for m, a in users])


def _move_buffers(model: Module, pipe: Pipeline) -> None:
    """Each buffer onto its module's stage (tensors entering a stage keep their nd-sbp on a mesh
    of the same ndim, else are replicated; ``sbp[stage]`` overrides)."""
    moved: dict = {}
    for name, m in model.named_modules():
        stage = pipe.stage_of(name)
        for key, b in list(m._buffers.items()):
            if b is not None:
                if id(b) not in moved:
                    moved[id(b)] = pipe.move(b, stage, f"buffer {name}.{key}".lstrip("."))
                m._buffers[key] = moved[id(b)]


def _wrap_forward(model: Module, pipe: Pipeline) -> None:
    """Route the model's inputs around its ``forward`` (an instance attribute, found before the
    class's): the pipeline's own try/finally restores them, whatever the hooks do."""
    had = "forward" in model.__dict__
    previous = model.__dict__.get("forward")
    inner = model.forward

    def forward(*args, **kwargs):
        return pipe.call_model(inner, args, kwargs)

    object.__setattr__(model, "forward", forward)

    def unwrap() -> None:
        if model.__dict__.get("forward") is not forward:
            return                      # replaced since by someone else: leave theirs
        if had:
            object.__setattr__(model, "forward", previous)
        else:
            del model.__dict__["forward"]

    pipe._unwrap = unwrap


def _install_hooks(model: Module, pipe: Pipeline, firsts: list) -> None:
    _wrap_forward(model, pipe)
    for name, m in model.named_modules():
        if _holds_tensors(m):   # installed first: the stage moves below are prepended to it
            pipe._placing.append(m.register_forward_pre_hook(
                lambda mod, _args, n=name: pipe.run_here(n, mod), prepend=True))
    for stage, m in enumerate(firsts, start=1):
        # prepend: the move happens before any hook the user registered on the module
        pipe.handles.append(m.register_forward_pre_hook(
            lambda _m, args, kwargs, s=stage: pipe.enter_stage(s, args, kwargs),
            with_kwargs=True, prepend=True))


def pipeline(model: Module, placements: Sequence[Placement], split: Sequence[str],
             rules: Sequence[Mapping | None] | None = None,
             sbp: Sequence | None = None) -> Module:
    """Lay ``model`` out as ``len(placements)`` pipeline stages; returns ``model``.

    Stage 0 starts at the model, stage i at the module named ``split[i-1]`` (a name of
    ``model.named_modules()``, in that order). Each stage's parameters are boxed to its
    placement by ``rules[i]`` (fnmatch patterns -> nd-sbp, as `sf.parallel.apply`; None:
    replicated), its buffers moved there. Tensors entering stage i take ``sbp[i]`` (an nd-sbp
    or a function of the tensor; None: their own nd-sbp when the mesh ndim is the same, else
    replicated). Every rank must call it alike (the boxing is collective); build the optimizer
    afterwards. Calling it again replaces the previous pipeline's hooks. A parameter used by
    modules of several stages goes on the tie placement (each stage holds a copy, their
    gradients all-reduced by the optimizer's step; `sbpflow.parallel.tie`). `ParallelizeError`
    on a wrong split, placements that share ranks, a buffer used by two stages, or a tied
    parameter whose stages' meshes or rules differ, or a split that leaves a stage without a
    module of its own (a split at ``net.0``, the first module: stage 0 would hold only the
    containers of stage 1's modules, its ranks idle)."""
    if not isinstance(model, Module):
        raise ParallelizeError(f"{_WHO}: expected an sf.nn.Module, got {type(model).__name__}")
    placements = _check_placements(placements, split)
    n = len(placements)
    rules_ = _per_stage(rules, n, "rules")
    specs = _check_sbp_specs(_per_stage(sbp, n, "sbp"), placements)
    module_stage, firsts, ties = _module_stages(model, split)
    old = pipeline_of(model)
    if old is not None:
        old.remove()
    pipe = Pipeline(placements, tuple(split), module_stage, specs)
    pipe.rules = rules_
    layouts = _param_layouts(model, module_stage, placements, rules_, ties)
    relayout(model, lambda name, _: layouts[name], _WHO)
    _move_buffers(model, pipe)
    _install_hooks(model, pipe, firsts)
    _tie_views(model, pipe, ties)
    object.__setattr__(model, "_sf_pipeline", pipe)
    return model


def pipeline_of(model: Module) -> Pipeline | None:
    """The `Pipeline` that `pipeline` made of ``model`` (None if it was not pipelined)."""
    return model.__dict__.get("_sf_pipeline")
