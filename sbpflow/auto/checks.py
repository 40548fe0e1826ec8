"""The checks of the strategy search's inputs, in one place. `sf.auto.search`
(`pipeline_search.search`) and the one-stage `strategy_search.one_stage_search` call
`check_search` (and ``sbpflow search`` reaches them through `search_cli.run_search`); the
preset graphs (`model_graphs`) check their sizes with `positive_size` and `check_heads`. Each
refusal is a `SearchInputError` (an `SbpError` and a ``ValueError``) naming the argument, its
value and the fix. `MemoryLimitWarning` is what the search warns with when its answer is over
the memory limit (docs/auto.md, 'Input checks').
"""

from __future__ import annotations

import math
import numbers

from ..errors import SearchInputError

__all__ = ["MemoryLimitWarning", "positive_size", "check_heads", "check_graph",
           "check_algorithm", "check_budget", "check_micro_batches", "check_stages",
           "check_schedule", "check_search"]


class MemoryLimitWarning(RuntimeWarning):
    """A search (``sf.auto.search``, ``sf.auto.parallelize``) answered with a strategy over the
    memory limit: none it found fits. The message says how far over, the least memory any
    one-stage strategy needs, and what to allow. Filter it by class, e.g.
    ``warnings.simplefilter("error", sf.auto.MemoryLimitWarning)`` to make it an error."""


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_size(who: str, name: str, value) -> None:
    """``value`` (argument ``name`` of ``who``) is an int >= 1."""
    if not _is_int(value) or value < 1:
        raise SearchInputError(f"{who}: {name} must be a positive int, got {value!r}; give "
                               f"{name}=1 or more")


def _divisors_near(n: int, k: int) -> list[int]:
    """The divisors of ``n`` closest to ``k`` (at most two: one below, one above)."""
    below = [d for d in range(min(k, n), 0, -1) if n % d == 0][:1]
    above = [d for d in range(k + 1, n + 1) if n % d == 0][:1]
    return below + above


def check_heads(who: str, heads: int, d_model: int) -> None:
    """``heads`` divides ``d_model`` (each head gets ``d_model // heads`` of the width)."""
    if d_model % heads:
        near = " or ".join(str(d) for d in _divisors_near(d_model, heads))
        raise SearchInputError(f"{who}: heads={heads} does not divide d_model={d_model} (each "
                               f"head takes d_model // heads of the width); give heads={near}, "
                               f"or a d_model that heads divides")


def _check_shape(graph, layer, what: str, shape) -> None:
    if shape is None and what == "weight_shape":
        return
    ok = isinstance(shape, (tuple, list)) and len(shape) > 0 and \
        all(_is_int(n) and n >= 1 for n in shape)
    if not ok:
        raise SearchInputError(
            f"search: layer {layer.name!r} of {graph.name} has {what} {shape!r}: every size "
            f"must be a positive int; build the graph from positive sizes (a preset's batch, "
            f"widths and lengths are 1 or more)")


def _check_attention(graph, layer) -> None:
    heads, batch = layer.attrs.get("heads"), layer.attrs.get("batch")
    width = layer.output_shape[-1]
    where = f"search: attention layer {layer.name!r} of {graph.name}"
    if heads is not None:
        if not _is_int(heads) or heads < 1:
            raise SearchInputError(f"{where} has heads={heads!r}; give a positive int")
        check_heads(where, heads, width)
    if batch is not None and (not _is_int(batch) or batch < 1
                              or layer.input_shape[0] % batch):
        raise SearchInputError(f"{where} has batch={batch!r} for {layer.input_shape[0]} "
                               f"tokens; give the sequences a step, a positive int that "
                               f"divides the tokens")


def check_graph(graph) -> None:
    """``graph`` has layers, each with shapes of positive sizes; an attention layer's heads
    divide its width and its batch (sequences) divides its tokens."""
    if not getattr(graph, "layers", None):
        raise SearchInputError(f"search: graph {graph!r} has no layers; give an "
                               f"sf.auto.LayerGraph of at least one layer")
    for layer in graph.layers:
        for what in ("input_shape", "weight_shape", "output_shape"):
            _check_shape(graph, layer, what, getattr(layer, what))
        if layer.kind == "attention":
            _check_attention(graph, layer)


def check_algorithm(algorithm, known) -> None:
    """``algorithm`` is one of ``known``."""
    if not isinstance(algorithm, str) or algorithm not in known:
        raise SearchInputError(f"search: unknown algorithm {algorithm!r}; give one of "
                               f"{sorted(known)} (cd: coordinate descent, the default)")


def check_budget(budget_s) -> None:
    """``budget_s`` is None (no cap) or a number of seconds >= 0 (0: the start strategy,
    searched no further; a pipeline search gives its last stage searches what is left of
    its budget, which may be nothing)."""
    if budget_s is None:
        return
    number = isinstance(budget_s, numbers.Real) and not isinstance(budget_s, bool)
    if not number or math.isnan(budget_s) or budget_s < 0:
        raise SearchInputError(f"search: budget_s must be a number of seconds >= 0 (or None: "
                               f"no cap), got {budget_s!r}; e.g. budget_s=30")


def check_micro_batches(micro_batches) -> None:
    """``micro_batches`` is ``"auto"`` or an int >= 1."""
    if micro_batches == "auto" and isinstance(micro_batches, str):
        return
    if not _is_int(micro_batches) or micro_batches < 1:
        raise SearchInputError(f"search: micro_batches must be an int >= 1 or 'auto' (the "
                               f"fewest that fit memory), got {micro_batches!r}; 1 means no "
                               f"gradient accumulation")


def check_stages(stages) -> None:
    """``stages`` is ``"auto"``, ``"search"`` or an int >= 1."""
    if isinstance(stages, str) and stages in ("auto", "search"):
        return
    if not _is_int(stages) or stages < 1:
        raise SearchInputError(f"search: stages must be 'auto', 'search' or an int >= 1 (1: "
                               f"no pipeline), got {stages!r}")


def check_schedule(schedule, known) -> None:
    """``schedule`` is one of ``known``."""
    if not isinstance(schedule, str) or schedule not in known:
        raise SearchInputError(f"search: unknown schedule {schedule!r}; give one of "
                               f"{list(known)}")


def check_search(graph, algorithm, known_algorithms, budget_s, micro_batches) -> None:
    """The arguments every search takes: the graph, the algorithm, the budget and the
    micro-batch count (the memory limit: `search.check_memory_limit`)."""
    check_graph(graph)
    check_algorithm(algorithm, known_algorithms)
    check_budget(budget_s)
    check_micro_batches(micro_batches)
