"""Torch op coverage on torch's OpInfo database (issue 35, part 4): the sweep that
``benchmarks/op_coverage.py`` and ``tests/ops/test_op_db.py`` share.

For each OpInfo entry of ``torch.testing._internal.common_methods_invocations.op_db`` that
supports float64 on CPU and is not random by nature, take its first sample input(s)
(``op.sample_inputs('cpu', torch.float64, requires_grad=op.supports_autograd)``, global RNG seeded
0 first), run ``op.op`` in plain torch (the reference, built here, outside any rank thread), then
run it on 4 rank threads with every tensor of the sample (``sample.input``, ``sample.args``,
``sample.kwargs``, tensors nested in lists / tuples / dicts too) replaced by a global tensor of
the same value in the layout under test, and compare:

* every output: ``full_tensor()`` of a global tensor against torch's tensor
  (``torch.testing.assert_close``, float64 defaults, NaN equal to NaN; dtype and shape too);
  outputs that are not tensors (bools, ints, sizes, ...) compared as values, structures
  (tuples, lists) element by element; every rank's result is checked;
* the gradient of the first input that requires grad: backward of ``sum_i (out_i * w_i).sum()``
  over the float outputs (after the sample's ``output_process_fn_grad``) that require grad in
  torch, ``w_i`` fixed random weights built here, then ``x.grad.full_tensor()`` against torch's
  ``torch.autograd.grad``.

Each (entry, layout, framework) is then ``pass``, ``wrong`` (any mismatch of value, dtype,
shape, structure or gradient: a silent wrong answer), ``error`` (an exception; its class, its
first line, whether it is an `sf.SbpError` (a "clear" error), and the phase: inputs, forward,
output, backward, grad, or timeout) or ``skipped`` (no reference: see below).

Layouts (`LAYOUTS`), per tensor input: ``S0``: ``S(0)`` over 4 ranks where dim 0 divides by 4,
else ``B``; ``S1``: the same with dim 1; ``2x2``: ranks ``[[0, 1], [2, 3]]``, per mesh dim
``(S(0), S(1))`` where that tensor dim divides by 2, else ``B``; and, not in the issue's list,
``S0u``: ``S(0)`` wherever dim 0 is not empty, uneven shards included (sbpflow and DTensor
both allow them; most OpInfo sizes are 5 or 10, so ``S0`` splits few entries). 0-d tensors and
empty dims are always ``B``.

Frameworks: ``sbpflow`` (``sf.launch(fn, 4, backend="threads", timeout=...)``; only the public
API: launch, placement, tensor, S, B, full_tensor, requires_grad_, backward, grad) and
``dtensor`` (``torch.distributed.tensor`` on 4 threads of torch's multi-threaded process group,
``Shard`` / ``Replicate`` as above; `dtensor_world` installs that process group for a block of
runs).

Not tried (``skipped`` with the reason, identical for both frameworks):

* not float64 on CPU (``torch.float64 not in op.supported_dtypes('cpu')``): not listed at all;
* random by nature (`RANDOM_OPS`, or any name containing ``dropout`` / ``rand`` / ``normal`` /
  ``bernoulli`` / ``multinomial`` but `_DETERMINISTIC_ANYWAY`; also ops whose values are
  uninitialised memory: ``empty*``, ``new_empty*``, ``resize_*``), and, whatever the name, a
  sample whose two torch runs under different seeds differ (the second one without OpInfo's
  ``wrapper_set_seed``: attention with ``dropout_p > 0``);
* samples with no tensor at all (factory functions: ``arange(1, 5)`` runs as plain torch);
* samples on which torch itself raises (forward-only is tried first when the autograd run
  raises, e.g. an in-place op on a leaf; the entry is then checked without gradient).

An entry with several samples (``samples=K``) is ``wrong`` if any sample is wrong, else
``error`` if any errs (the first error is kept), else ``pass`` (``skipped`` samples do not
count; all skipped: the entry is skipped).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import operator
import re
import threading
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

# -- which entries ----------------------------------------------------------------------------
# Random by nature (or uninitialised output). OpInfo has no flag for all of them; the names
# (full keys "name[.variant]") below, plus the word rules of `random_reason`.
RANDOM_OPS = frozenset({
    "bernoulli", "multinomial", "normal", "normal.number_mean", "normal.in_place", "uniform",
    "cauchy", "exponential", "geometric", "log_normal", "randn", "rand", "randint",
    "randn_like", "rand_like", "randint_like",
    "nn.functional.rrelu",                   # random slopes in training mode
    "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d",
    "nn.functional.gumbel_softmax",
    "svd_lowrank", "pca_lowrank",            # random projections
    "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
    "new_empty_strided", "resize_", "resize_as_",   # uninitialised memory
})
_RANDOM_WORDS = ("dropout", "rand", "normal", "bernoulli", "multinomial")
_DETERMINISTIC_ANYWAY = frozenset({
    "nn.functional.feature_alpha_dropout.without_train",  # training=False: the identity
    "native_dropout_backward",                            # takes its mask as an input
    "nn.functional.normalize", "masked.normalize",        # not 'normal' sampling
})


def entry_key(op) -> str:
    """``name`` or ``name.variant``: unique in op_db."""
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def random_reason(op) -> str | None:
    key = entry_key(op)
    if key in _DETERMINISTIC_ANYWAY:
        return None
    if key in RANDOM_OPS or op.name in RANDOM_OPS:
        return "random by nature"
    if any(w in op.name for w in _RANDOM_WORDS):
        return "random by nature (name)"
    return None


_OP_DB = None


def op_db() -> list:
    """The OpInfo entries that support float64 on CPU, in op_db order (import: a few s)."""
    global _OP_DB
    if _OP_DB is None:
        frozen = torch.backends.flags_frozen()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torch.testing._internal.common_methods_invocations import op_db as db
        # torch's common_utils calls torch.backends.disable_global_flags() on import (plain
        # `torch.backends.<x>.<flag> = v` then raises): undo that for the rest of the process
        torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = not frozen
        _OP_DB = [op for op in db if torch.float64 in op.supported_dtypes("cpu")]
    return _OP_DB


def entries(names: Sequence[str] | None = None) -> list:
    """op_db entries (float64 on CPU), all or those whose key or name is in ``names``."""
    ops = op_db()
    if names is None:
        return list(ops)
    wanted = set(names)
    found = [op for op in ops if entry_key(op) in wanted or op.name in wanted]
    missing = wanted - {entry_key(op) for op in found} - {op.name for op in found}
    if missing:
        raise KeyError(f"not float64 OpInfo entries: {sorted(missing)}")
    return found


# -- layouts ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """Where each tensor input goes: ``mesh`` (nested rank lists) and, per mesh dim, the tensor
    axis it splits when that axis divides by the mesh dim's size (else broadcast)."""
    name: str
    mesh: tuple
    axes: tuple   # one tensor axis per mesh dim
    uneven: bool = False   # split any non-empty axis, dividing or not (uneven shards)

    @property
    def mesh_shape(self) -> tuple:
        return (len(self.mesh), len(self.mesh[0])) if isinstance(self.mesh[0], (list, tuple)) \
            else (len(self.mesh),)

    def spec(self, shape: Sequence[int]) -> tuple:
        """Per mesh dim: the split axis, or None for broadcast."""
        out = []
        for n, axis in zip(self.mesh_shape, self.axes):
            ok = axis < len(shape) and shape[axis] > 0 and (self.uneven
                                                             or shape[axis] % n == 0)
            out.append(axis if ok else None)
        return tuple(out)

    def mesh_list(self):
        return [list(r) for r in self.mesh] if len(self.mesh_shape) == 2 else list(self.mesh)


LAYOUTS = {
    "S0": Layout("S0", (0, 1, 2, 3), (0,)),
    "S0u": Layout("S0u", (0, 1, 2, 3), (0,), uneven=True),
    "S1": Layout("S1", (0, 1, 2, 3), (1,)),
    "2x2": Layout("2x2", ((0, 1), (2, 3)), (0, 1)),
}
WORLD = 4


# -- trees of arguments -------------------------------------------------------------------------
def _has_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, (list, tuple)):
        return any(_has_tensor(o) for o in obj)
    if isinstance(obj, dict):
        return any(_has_tensor(o) for o in obj.values())
    return False


def map_tensors(fn: Callable, obj):
    """``obj`` with each torch tensor ``t`` replaced by ``fn(t)`` (lists, tuples, dicts; a
    container without tensors is returned as it is, so sizes stay sizes)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if not _has_tensor(obj):
        return obj
    if isinstance(obj, list):
        return [map_tensors(fn, o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(fn, o) for o in obj)
    return {k: map_tensors(fn, v) for k, v in obj.items()}


class _Slot:
    """A tensor's place in a sample's argument tree (index into `Case.values`)."""
    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _fill(obj, fill: Callable):
    if isinstance(obj, _Slot):
        return fill(obj.i)
    if isinstance(obj, list):
        return [_fill(o, fill) for o in obj]
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(_fill(o, fill) for o in obj)
    if isinstance(obj, dict):
        return {k: _fill(v, fill) for k, v in obj.items()}
    return obj


def leaves(obj) -> list:
    """Leaves of an output, depth first (tuples, structseqs such as torch.return_types, lists)."""
    if isinstance(obj, (list, tuple)):
        return [x for o in obj for x in leaves(o)]
    return [obj]


def _is_float(t) -> bool:
    return t.dtype.is_floating_point


# -- cases: one sample with torch's answers -------------------------------------------------------
@dataclass
class Case:
    """One sample of one entry, with its torch reference (all built outside any rank)."""
    key: str
    index: int                  # which sample
    op: Any
    tree: tuple                 # (input, args, kwargs) with tensors replaced by _Slot
    values: list                # detached tensors
    grads: list                 # requires_grad per value
    process: Callable           # sample.output_process_fn_grad
    expected: Any = None        # torch's outputs (plain values)
    first: int | None = None    # value index whose gradient is compared
    weights: list = field(default_factory=list)   # [(leaf position, weight tensor)]
    expected_grad: Any = None   # torch's gradient of values[first] (None: no gradient)
    skip: str | None = None     # why there is no reference

    def arguments(self, make: Callable) -> tuple:
        """(input, args, kwargs) with ``make(i)`` in place of each tensor."""
        made: dict[int, Any] = {}

        def fill(i):
            if i not in made:
                made[i] = make(i)
            return made[i]
        inp, args, kwargs = _fill(self.tree, fill)
        return inp, args, kwargs, made


def _detached_tree(sample) -> tuple:
    values, grads = [], []
    seen: dict[int, int] = {}

    def slot(t: torch.Tensor):
        if id(t) not in seen:
            seen[id(t)] = len(values)
            values.append(t.detach().clone())
            grads.append(bool(t.requires_grad))
        return _Slot(seen[id(t)])
    tree = (map_tensors(slot, sample.input), map_tensors(slot, tuple(sample.args)),
            map_tensors(slot, dict(sample.kwargs)))
    return tree, values, grads


def _plain(obj):
    """Torch's output as plain values (structseqs to tuples, tensors detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return type(obj)(_plain(o) for o in obj) if type(obj) in (list, tuple) \
            else tuple(_plain(o) for o in obj)
    return obj


# entries whose op.op is a lambda around an unbound torch.Tensor method: run as that method
_AS_METHOD = {"item": "item"}
# reflected operators: run as the expression a user writes (``2 / x`` calls x.__rtruediv__;
# Python 3 has no __rdiv__, torch.Tensor keeps it as an alias)
_REFLECTED = {"__radd__": operator.add, "__rsub__": operator.sub, "__rmul__": operator.mul,
              "__rdiv__": operator.truediv, "__rmod__": operator.mod, "__rpow__": operator.pow,
              "__rmatmul__": operator.matmul}


def call(op, inp, args, kwargs):
    """``op.op(inp, *args, **kwargs)``; where ``op.op`` is an unbound ``torch.Tensor`` method
    (``torch.Tensor.__getitem__``, ``__radd__``, ``cdouble``, ...; or wraps one: `_AS_METHOD`)
    as the method of ``inp``, as a user writes it (``x[i]``, ``1 + x``, ``x.item()``): such a
    descriptor refuses a ``self`` that is not a torch tensor before any ``__torch_function__``
    (a torch.Tensor subclass such as DTensor gets the same call either way)."""
    if entry_key(op) in _REFLECTED and len(args) == 1 and not kwargs \
            and not isinstance(inp, torch.Tensor):
        return _REFLECTED[entry_key(op)](args[0], inp)
    if entry_key(op) in _AS_METHOD and not isinstance(inp, torch.Tensor):
        return getattr(inp, _AS_METHOD[entry_key(op)])(*args, **kwargs)
    name = getattr(op.op, "__name__", None)
    if name and getattr(torch.Tensor, name, None) is op.op and not isinstance(inp, torch.Tensor):
        return getattr(inp, name)(*args, **kwargs)
    return op.op(inp, *args, **kwargs)


def _torch_inputs(case: Case, with_grad: bool):
    def make(i):
        v = case.values[i].clone()
        return v.requires_grad_() if with_grad and case.grads[i] else v
    return case.arguments(make)


def _same(a, b) -> bool:
    """Equal outputs of two torch runs (to assert_close's float64 tolerance: LAPACK need not
    be bitwise repeatable): for the non-determinism check."""
    try:
        return compare(a, b) is None
    except Exception:  # noqa: BLE001  (a dtype assert_close cannot take, e.g. complex32)
        return all(x is y or (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                              and x.shape == y.shape and x.dtype == y.dtype)
                   for x, y in zip(leaves(a), leaves(b)))


@contextlib.contextmanager
def _unseeded(op):
    """OpInfo runs random ops through ``wrapper_set_seed`` (it seeds torch's RNG first, so two
    torch runs agree); for the block, that op runs without it, so a sample that draws random
    numbers (attention with dropout_p > 0, ...) gives different values under different seeds."""
    fn = op.op
    names = getattr(getattr(fn, "__code__", None), "co_names", ())
    scope = getattr(fn, "__globals__", None)
    if "wrapper_set_seed" not in names or not scope or "wrapper_set_seed" not in scope:
        yield
        return
    kept = scope["wrapper_set_seed"]
    scope["wrapper_set_seed"] = lambda f, *args, **kwargs: f(*args, **kwargs)
    try:
        yield
    finally:
        scope["wrapper_set_seed"] = kept


def prepare(op, samples: int = 1, seed: int = 0) -> list[Case]:
    """The first ``samples`` sample inputs of ``op`` with torch's outputs and gradient."""
    key = entry_key(op)
    why = random_reason(op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(seed)
        try:
            raw = list(itertools.islice(
                op.sample_inputs("cpu", torch.float64, requires_grad=op.supports_autograd),
                samples))
        except Exception as e:  # noqa: BLE001  (torch's own generator failed)
            return [Case(key, 0, op, ((), (), {}), [], [], lambda x: x,
                         skip=f"sample_inputs raised {type(e).__name__}: {_first_line(e)}")]
    cases = []
    for index, sample in enumerate(raw):
        tree, values, grads = _detached_tree(sample)
        case = Case(key, index, op, tree, values, grads, sample.output_process_fn_grad)
        if why:
            case.skip = why
        elif not values:
            case.skip = "no tensor input"
        elif any(v.layout != torch.strided for v in values):
            case.skip = "sparse input"
        else:
            try:
                _reference(case, seed)
            except Exception as e:  # noqa: BLE001  (a sample this harness cannot take)
                case.skip = f"harness: {type(e).__name__}: {_first_line(e)}"
        cases.append(case)
    if not cases:
        cases.append(Case(key, 0, op, ((), (), {}), [], [], lambda x: x,
                          skip="no sample input"))
    return cases


def _reference(case: Case, seed: int) -> None:
    """Torch's outputs and gradient for ``case`` (sets ``skip`` when torch raises)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, ts, with_grad = None, None, any(case.grads)
        for attempt in ((True, False) if with_grad else (False,)):
            try:
                torch.manual_seed(seed + 1)
                inp, args, kwargs, ts = _torch_inputs(case, attempt)
                out = call(case.op, inp, args, kwargs)
                with_grad = attempt
                break
            except Exception as e:  # noqa: BLE001
                err = e
        else:
            case.skip = f"torch raised {type(err).__name__}: {_first_line(err)}"
            return
        if not with_grad:
            case.grads = [False] * len(case.grads)
        try:  # random whatever the name: two runs under different seeds differ
            torch.manual_seed(seed + 2)
            inp2, args2, kwargs2, _ = _torch_inputs(case, False)
            with _unseeded(case.op):
                again = call(case.op, inp2, args2, kwargs2)
        except Exception as e:  # noqa: BLE001
            case.skip = f"torch raised on a second run {type(e).__name__}: {_first_line(e)}"
            return
        if any(isinstance(t, torch.Tensor) and t.layout != torch.strided
               for t in leaves(out)):
            case.skip = "sparse output"
            return
        if not _same(_plain(out), _plain(again)):
            case.skip = "random (two torch runs differ)"
            return
        case.expected = _plain(out)
        first = next((i for i in sorted(ts) if case.grads[i] and _is_float(case.values[i])),
                     None)
        if first is None:
            return
        try:
            outs = leaves(case.process(out))
        except Exception:  # noqa: BLE001
            return
        g = torch.Generator().manual_seed(seed + 7)
        terms = []
        for pos, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and _is_float(o) and o.requires_grad:
                w = torch.randn(o.shape, dtype=o.dtype, generator=g)
                case.weights.append((pos, w))
                terms.append((o * w).sum())
        if not terms:
            return
        case.first = first
        (grad,) = torch.autograd.grad(sum(terms[1:], terms[0]), ts[first], allow_unused=True)
        case.expected_grad = None if grad is None else grad.detach().clone()


# -- outcomes ---------------------------------------------------------------------------------
@dataclass
class Outcome:
    key: str
    layout: str
    framework: str
    status: str                  # pass / wrong / error / skipped
    detail: str = ""             # what differs, the error's first line, or why skipped
    error: str = ""              # exception class
    clear: bool = False          # an sf.SbpError
    phase: str = ""              # inputs / forward / output / backward / grad / timeout
    split: bool = False          # some input was split (not every tensor broadcast)
    grad: bool = False           # a gradient was compared (or would have been)
    sample: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def _first_line(e: BaseException, limit: int = 400) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return line[:limit]


def _squash(text: str, limit: int = 300) -> str:
    return re.sub(r"\s+", " ", text).strip()[:limit]


def compare(actual, expected, where: str = "output") -> str | None:
    """None if ``actual`` equals ``expected`` (torch's), else what differs."""
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            return f"{where}: {type(actual).__name__} where torch gives a tensor"
        try:
            torch.testing.assert_close(actual, expected, equal_nan=True)
        except AssertionError as e:
            return f"{where}: {_squash(str(e))}"
        return None
    if isinstance(expected, (list, tuple)) and not isinstance(expected, torch.Size):
        if not isinstance(actual, (list, tuple)) or isinstance(actual, torch.Size):
            return f"{where}: {type(actual).__name__} where torch gives a {type(expected).__name__}"
        if len(actual) != len(expected):
            return f"{where}: {len(actual)} items where torch gives {len(expected)}"
        for i, (a, b) in enumerate(zip(actual, expected)):
            d = compare(a, b, f"{where}[{i}]")
            if d:
                return d
        return None
    if isinstance(actual, torch.Tensor):
        return f"{where}: a tensor where torch gives {type(expected).__name__} {expected!r}"
    if isinstance(expected, float) and isinstance(actual, (int, float)):
        if math.isnan(expected) and math.isnan(actual):
            return None
        if math.isclose(actual, expected, rel_tol=1e-7, abs_tol=1e-7):
            return None
        return f"{where}: {actual!r} where torch gives {expected!r}"
    try:
        same = bool(actual == expected)
    except Exception:  # noqa: BLE001
        same = False
    return None if same else f"{where}: {actual!r} where torch gives {expected!r}"


def _check(case: Case, results: list) -> str | None:
    """What differs between any rank's (outputs, gradient) and torch's, or None."""
    for r, (out, grad) in enumerate(results):
        d = compare(out, case.expected)
        if d is None and case.first is not None:
            if case.expected_grad is None:
                if grad is not None and not (isinstance(grad, torch.Tensor)
                                             and not grad.any()):
                    d = "grad: a non-zero gradient where torch gives none"
            elif grad is None:
                d = "grad: no gradient where torch gives one"
            else:
                d = compare(grad, case.expected_grad, "grad")
        if d:
            return d if len(results) == 1 else f"rank {r}: {d}"
    return None


# -- one run on the ranks: shared by both frameworks -----------------------------------------------
def _rank_body(case: Case, layout: Layout, fw) -> tuple:
    """What every rank runs: the op on global tensors; returns (outputs, gradient) as plain
    values. An exception leaves with ``sweep_phase`` set."""
    phase = "inputs"
    try:
        def make(i):
            t = fw.make(case.values[i].clone(), layout.spec(case.values[i].shape))
            return t.requires_grad_() if case.grads[i] else t
        inp, args, kwargs, made = case.arguments(make)
        phase = "forward"
        out = call(case.op, inp, args, kwargs)
        phase = "output"
        full = fw.full(out)
        grad = None
        if case.first is not None:
            phase = "backward"
            outs = leaves(case.process(out))
            terms = []
            for pos, w in case.weights:
                terms.append((outs[pos] * fw.make(w.clone(), (None,) * len(layout.axes))).sum())
            sum(terms[1:], terms[0]).backward()
            phase = "grad"
            g = made[case.first].grad
            grad = None if g is None else fw.full(g)
        return full, grad
    except BaseException as e:
        with contextlib.suppress(Exception):
            e.sweep_phase = phase
        raise


def _to_plain(obj, is_global: Callable, full: Callable):
    if is_global(obj):
        return full(obj).detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (list, tuple)) and not isinstance(obj, torch.Size):
        return [_to_plain(o, is_global, full) for o in obj] if type(obj) is list \
            else tuple(_to_plain(o, is_global, full) for o in obj)
    return obj


def _error_outcome(case, layout, fw_name, e: BaseException, clear_type) -> Outcome:
    return Outcome(case.key, layout.name, fw_name, "error", _first_line(e), type(e).__name__,
                   clear_type is not None and isinstance(e, clear_type),
                   getattr(e, "sweep_phase", ""), sample=case.index)


# -- sbpflow --------------------------------------------------------------------------------
class _SbpflowFW:
    def __init__(self, sf, layout: Layout) -> None:
        self.sf = sf
        self.pl = sf.placement("cpu", ranks=layout.mesh_list())

    def make(self, value: torch.Tensor, spec: tuple):
        sf = self.sf
        return sf.tensor(value, placement=self.pl,
                         sbp=tuple(sf.B if a is None else sf.S(a) for a in spec))

    def full(self, obj):
        return _to_plain(obj, lambda x: isinstance(x, self.sf.GlobalTensor),
                         lambda x: x.full_tensor())


def _with_deadline(fn: Callable, seconds: float):
    """``fn()`` on a helper thread; TimeoutError if it has not returned after ``seconds`` (the
    thread is then left behind as a daemon)."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e
    t = threading.Thread(target=run, daemon=True, name="op-sweep")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise TimeoutError(f"no result after {seconds:.0f} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_sbpflow(case: Case, layout: Layout, timeout: float = 20.0) -> Outcome:
    """``case`` on 4 sbpflow rank threads in ``layout``."""
    import sbpflow as sf
    t0 = time.perf_counter()

    def body():
        return _rank_body(case, layout, _SbpflowFW(sf, layout))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = _with_deadline(
                lambda: sf.launch(body, WORLD, backend="threads", timeout=timeout),
                3 * timeout)
    except TimeoutError as e:
        out = Outcome(case.key, layout.name, "sbpflow", "error", str(e), "TimeoutError",
                      False, "timeout", sample=case.index)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        out = _error_outcome(case, layout, "sbpflow", e, sf.SbpError)
    else:
        out = _judged(case, layout, "sbpflow", results)
    return _stamped(out, case, layout, t0)


def _judged(case: Case, layout: Layout, framework: str, results) -> Outcome:
    """A run's outcome from its results: "pass", or "wrong" with what differs."""
    d = _check(case, results)
    return Outcome(case.key, layout.name, framework, "wrong" if d else "pass", d or "",
                   sample=case.index)


def _stamped(out: Outcome, case: Case, layout: Layout, t0: float) -> Outcome:
    """``out`` with whether an input was split, a gradient compared, and the seconds taken."""
    out.split = _splits(case, layout)
    out.grad = case.first is not None
    out.seconds = time.perf_counter() - t0
    return out


def _splits(case: Case, layout: Layout) -> bool:
    return any(a is not None for v in case.values for a in layout.spec(v.shape))


# -- DTensor on torch's multi-threaded process group ----------------------------------------------
class _DTensorFW:
    def __init__(self, mesh) -> None:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        self.mesh, self.DTensor = mesh, DTensor
        self.Replicate, self.Shard, self.distribute = Replicate, Shard, distribute_tensor

    def make(self, value: torch.Tensor, spec: tuple):
        placements = [self.Replicate() if a is None else self.Shard(a) for a in spec]
        return self.distribute(value, self.mesh, placements)

    def full(self, obj):
        return _to_plain(obj, lambda x: isinstance(x, self.DTensor), lambda x: x.full_tensor())


@contextlib.contextmanager
def dtensor_world():
    """Install torch's multi-threaded process group (thread-local c10d worlds) for the block;
    `run_dtensor` needs it. It also turns autograd's multithreading off until the end."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg
    log = logging.getLogger("torch.distributed.tensor")  # its redistribution advice, per rank
    level = log.level
    log.setLevel(logging.ERROR)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    mtpg._install_threaded_pg()
    try:
        yield
    finally:
        mtpg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        log.setLevel(level)


def run_dtensor(case: Case, layout: Layout, timeout: float = 20.0) -> Outcome:
    """``case`` as DTensors on 4 threads of torch's threaded process group (inside
    `dtensor_world`)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup
    t0 = time.perf_counter()
    store = dist.HashStore()
    results: list = [None] * WORLD
    errors: list = []   # (rank, exception) in the order they happened
    lock = threading.Lock()

    def wake(e: BaseException) -> None:
        """Wake the ranks waiting in a collective (they leave with SystemExit). Under the
        group's lock: torch's handler walks the dict of open collectives unguarded (another
        rank opening one meanwhile raised 'dictionary changed size during iteration')."""
        try:
            with ProcessLocalGroup._coll_lock:
                ProcessLocalGroup.exception_handle(e)
        except Exception:  # noqa: BLE001  (the deadline below still ends the run)
            pass

    def worker(rank: int) -> None:
        try:
            dist.init_process_group(backend="threaded", rank=rank, world_size=WORLD,
                                    store=store)
        except BaseException as e:  # noqa: BLE001
            with lock:
                errors.append((rank, e))
            wake(e)
            return
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mesh = DeviceMesh("cpu", layout.mesh_list())
                results[rank] = _rank_body(case, layout, _DTensorFW(mesh))
        except BaseException as e:  # noqa: BLE001
            with lock:
                errors.append((rank, e))
            wake(e)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()

    threads = [threading.Thread(target=worker, args=(r,), daemon=True, name=f"dtensor-{r}")
               for r in range(WORLD)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 3 * timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0.0))
    timed_out = any(t.is_alive() for t in threads)
    if timed_out:
        wake(TimeoutError())
        for t in threads:
            t.join(2.0)
    ProcessLocalGroup.reset()
    real = [(r, e) for r, e in errors if not isinstance(e, SystemExit)]
    if timed_out:
        out = Outcome(case.key, layout.name, "dtensor", "error",
                      f"no result after {3 * timeout:.0f} s", "TimeoutError", False, "timeout",
                      sample=case.index)
    elif real or errors:
        out = _error_outcome(case, layout, "dtensor", (real or errors)[0][1], None)
    else:
        out = _judged(case, layout, "dtensor", results)
    return _stamped(out, case, layout, t0)


RUNNERS = {"sbpflow": run_sbpflow, "dtensor": run_dtensor}


# -- the sweep ------------------------------------------------------------------------------------
def combine(outcomes: list[Outcome]) -> Outcome:
    """One entry's outcome from its samples' (see the module doc)."""
    tried = [o for o in outcomes if o.status != "skipped"]
    if not tried:
        return outcomes[0]
    for status in ("wrong", "error"):
        hit = [o for o in tried if o.status == status]
        if hit:
            first = hit[0]
            break
    else:
        first = tried[0]
    out = Outcome(**first.as_dict())
    out.split = any(o.split for o in tried)
    out.grad = any(o.grad for o in tried)
    out.seconds = sum(o.seconds for o in outcomes)
    return out


def skipped(case: Case, layout: str, framework: str) -> Outcome:
    return Outcome(case.key, layout, framework, "skipped", case.skip or "", sample=case.index)


def prepare_all(ops: Sequence, samples: int = 1) -> list[tuple]:
    """``[(op, cases)]``: every entry's samples with torch's answers (`prepare`)."""
    return [(op, prepare(op, samples)) for op in ops]


def run(prepared: Sequence[tuple], framework: str = "sbpflow", layouts: Sequence[str] = ("S0",),
        timeout: float = 20.0, progress: Callable | None = None) -> list[Outcome]:
    """One framework on prepared entries: a combined `Outcome` per (layout, entry), layouts
    in turn (DTensor's process group installed once for all of them). ``progress(outcome)`` is
    called after each."""
    out: list[Outcome] = []
    with dtensor_world() if framework == "dtensor" else contextlib.nullcontext():
        for lname in layouts:
            layout = LAYOUTS[lname]
            for _, cases in prepared:
                res = combine([skipped(c, lname, framework) if c.skip
                               else RUNNERS[framework](c, layout, timeout) for c in cases])
                out.append(res)
                if progress:
                    progress(res)
    return out


def sweep(ops: Sequence, layouts: Sequence[str] = ("S0",),
          frameworks: Sequence[str] = ("sbpflow",), samples: int = 1, timeout: float = 20.0,
          progress: Callable | None = None) -> list[Outcome]:
    """Every (entry, layout, framework): one combined `Outcome` each, all of sbpflow's before
    DTensor's."""
    prepared = prepare_all(ops, samples)
    return [o for fw in frameworks for o in run(prepared, fw, layouts, timeout, progress)]


# -- expected failures -------------------------------------------------------------------------
def read_expected(path) -> dict[tuple[str, str], str]:
    """``{(key, layout): reason}`` from a file of lines ``key  layout  reason`` (``#`` comments)."""
    table = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split(None, 2)
            if len(parts) < 2:
                raise ValueError(f"{path}: expected 'key layout reason', got {line!r}")
            table[(parts[0], parts[1])] = parts[2] if len(parts) > 2 else ""
    return table


def reason(o: Outcome) -> str:
    if o.status == "wrong":
        return f"WRONG VALUE: {o.detail}"
    clear = "" if o.clear else " (not an SbpError)"
    phase = f" [{o.phase}]" if o.phase and o.phase != "forward" else ""
    return f"{o.error}{clear}{phase}: {o.detail}"


# the arguments' layouts in an UnsupportedTorchFunction message (its why and advice stay)
_CALLED_WITH = re.compile(r"; called with (global tensors|.*? on \w+\[[\[\]\d, ]*\])")


def write_expected(path, outcomes: Sequence[Outcome], header: str = "") -> int:
    """Write sbpflow's failures (wrong and error) as ``key  layout  reason`` lines, merged with
    the lines already in ``path`` for (key, layout) pairs this sweep did not run."""
    import os
    ran = {(o.key, o.layout) for o in outcomes if o.framework == "sbpflow"}
    old = read_expected(path) if os.path.exists(path) else {}
    table = {k: v for k, v in old.items() if k not in ran}
    for o in outcomes:
        if o.framework == "sbpflow" and o.status in ("wrong", "error"):
            table[(o.key, o.layout)] = _squash(_CALLED_WITH.sub("", reason(o)), 200)
    order = {k: i for i, k in enumerate(entry_key(op) for op in op_db())}
    lines = sorted(table.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 1 << 30),
                                                  kv[0][0]))
    width = max([len(k) for (k, _), _ in lines] + [10])
    with open(path, "w") as f:
        f.write(header)
        for (key, layout), why in lines:
            f.write(f"{key:<{width}}  {layout:<4}  {why}\n")
    return len(lines)
