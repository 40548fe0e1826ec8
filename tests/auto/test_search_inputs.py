"""Bad or extreme search inputs: the search answers or names the fix, never a raw error.

Found by probing as a user: a tied GPT with pipeline stages under a memory limit nothing meets
crashed (the stage's tied head has a weight of its own); a memory limit of 0 divided by zero;
the Megatron baseline and ``evaluate`` priced micro-batch counts that split sequences, which
the search refuses; ``parallelize`` laid out a strategy over the limit without a word.
"""

import math
import warnings

import pytest
import torch

import sbpflow as sf
from sbpflow.auto import baselines, model_graphs
from sbpflow.models import mlp_class

GiB = 2 ** 30


def _cluster(devices: int = 6):
    return sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=devices)


@pytest.mark.parametrize("stages", [2, 3, "search"])
def test_tied_stages_under_a_limit_nothing_meets(stages):
    g = model_graphs.gpt(layers=2, d_model=256, heads=4, seq=128, batch=12, vocab=1000,
                         tied=True)
    with pytest.warns(sf.auto.MemoryLimitWarning, match="over the memory limit of 1 MiB"):
        r = sf.auto.search(g, _cluster(), memory_limit=2 ** 20, stages=stages)
    assert not r.fits
    assert r.strategy.pipeline is not None
    # the answer is priced as evaluate prices it
    bd = sf.auto.evaluate(g, r.strategy, _cluster())
    assert math.isclose(bd.time, r.breakdown.time, rel_tol=1e-9)


@pytest.mark.parametrize("limit", [0, -1, float("nan"), "8", True])
def test_memory_limit_must_be_positive(limit):
    g = model_graphs.gpt(layers=2, d_model=64, heads=4, seq=16, batch=12, vocab=100)
    for kwargs in (dict(stages=1), dict()):
        with pytest.raises(sf.SbpError, match="memory_limit must be a number of bytes > 0"):
            sf.auto.search(g, _cluster(), memory_limit=limit, **kwargs)
    with pytest.raises(sf.SbpError, match="memory_limit must be"):
        sf.auto.single_mesh_search(g, _cluster(), memory_limit=limit)


def test_megatron_and_evaluate_refuse_split_sequences():
    g = model_graphs.gpt(layers=4, d_model=256, heads=4, seq=64, batch=12, vocab=1000)
    c = _cluster()
    with pytest.raises(sf.GraphError, match="5 micro-batches would split"):
        baselines.megatron(g, c, tp=2, pp=3, micro_batches=5)
    dp = baselines.megatron(g, c, tp=1, dp=6)
    with pytest.raises(sf.GraphError, match="8 micro-batches would split"):
        sf.auto.evaluate(g, dp, c, micro_batches=8)
    assert sf.auto.evaluate(g, dp, c, micro_batches=4).time > 0  # 4 divides 12
    with pytest.raises(ValueError, match=r"tp 4 x pp 1 does not divide the cluster's 6"):
        baselines.megatron(g, c, tp=4)


def _mlp_rank(limit, **options):
    model = mlp_class(sf.nn, sf.nn.functional)((10, 14, 5))
    g = torch.Generator().manual_seed(0)  # (the traced inputs' shapes are what counts)
    x, y = torch.randn(8, 10, generator=g), torch.randint(0, 5, (8,), generator=g)
    pl = sf.placement("cpu", [0, 1])
    return sf.auto.parallelize(model, [x, y], pl, memory_limit=limit, **options).notes


def test_parallelize_says_when_nothing_fits():
    # (the warning module's state is global: caught around the launch, from both ranks)
    with pytest.warns(RuntimeWarning, match="over the memory limit"):
        notes = sf.launch(_mlp_rank, 2, args=(100,))
    assert all(any("over the memory limit" in n for n in ns) for ns in notes), notes
    assert any("allow zero=True, recompute=True, stage" in n for n in notes[0]), notes[0]
    with pytest.warns(RuntimeWarning, match="over the memory limit"):
        notes = sf.launch(lambda: _mlp_rank(100, zero=True, recompute=True), 2)
    advice = [n for n in notes[0] if "over the memory limit" in n]
    assert advice and "zero=True" not in advice[0] and "recompute" not in advice[0]
    assert "allow stages='search', or use more devices" in advice[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        notes = sf.launch(_mlp_rank, 2, args=(GiB,))
    assert not any("over the memory limit" in n for ns in notes for n in ns)


def test_auto_stages_try_pipelines_when_the_one_stage_search_finds_nothing_that_fits():
    """GPT-2 (tied head) on one DGX node under 1 GiB: the one-stage floor (0.93 GiB) is under
    the limit, but coordinate descent finds no one-stage strategy under it; the default
    stages="auto" then tries pipelines instead of returning an over-the-limit strategy."""
    g = sf.auto.model_graphs.gpt(tied=True)
    c = sf.cost.Cluster.preset("dgx-a100", nodes=1)
    limit = 2 ** 30
    assert sf.auto.pipeline_search.one_stage_floor(g, c, 1) <= limit
    with pytest.warns(sf.auto.MemoryLimitWarning, match="so one may fit that the search did "
                                                        "not find"):
        assert not sf.auto.search(g, c, memory_limit=limit, stages=1).fits
    r = sf.auto.search(g, c, memory_limit=limit)
    assert r.fits and r.breakdown.memory["total"] <= limit


def test_parallelize_names_arguments_of_the_wrong_kind():
    """A placement given as ranks, a cluster given as a preset's name, a function as the
    model, a strategy given as a string or as a dict naming unknown layers: each a
    ParallelizeError naming it (were raw AttributeError / KeyError, or "2 layers" for "dp")."""
    model = mlp_class(sf.nn, sf.nn.functional)((10, 14, 5))
    x, y = torch.zeros(8, 10), torch.zeros(8, dtype=torch.int64)

    def body(case):
        pl = sf.placement("cpu", [0])
        call = {"placement": lambda: sf.auto.parallelize(model, [x, y], [0]),
                "cluster": lambda: sf.auto.parallelize(model, [x, y], pl, cluster="dgx-a100"),
                "model": lambda: sf.auto.parallelize(lambda v: v, [x, y], pl),
                "strategy str": lambda: sf.auto.parallelize(model, [x, y], pl, strategy="dp"),
                "strategy dict": lambda: sf.auto.parallelize(model, [x, y], pl,
                                                             strategy={"nope": None})}[case]
        try:
            call()
        except sf.errors.ParallelizeError as exc:
            return str(exc)
    for case, text in [("placement", "placement must be an sf.placement"),
                       ("cluster", "Cluster.preset('dgx-a100'"),
                       ("model", "got function"),
                       ("strategy str", "got 'dp'"),
                       ("strategy dict", "names unknown ones ['nope']")]:
        got = sf.launch(body, 1, args=(case,))[0]
        assert got is not None and text in got, (case, got)


def _gpt_graph(**sizes):
    kw = dict(layers=2, d_model=64, heads=4, seq=32, batch=8, vocab=100)
    return model_graphs.gpt(**{**kw, **sizes})


def _search_error(call) -> tuple | None:
    """(class name, message, whether it is an SbpError and a ValueError) of what ``call``
    raises; None if it returns."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test compares what was raised
        return type(exc).__name__, str(exc), isinstance(exc, sf.SbpError) and \
            isinstance(exc, ValueError)  # `except ValueError` keeps working
    return None


def test_bad_search_input_names_the_argument_its_value_and_the_fix():
    """Each was a raw error (``min() arg is an empty sequence`` for batch=-4 or d_model=0, a
    ZeroDivisionError for micro_batches=0, a plain ValueError for the algorithm) or accepted
    (heads=5 with d_model=64, budget_s=-1)."""
    c = _cluster()
    g = _gpt_graph()
    bad_layer = sf.auto.LayerGraph([model_graphs.linear_layer("fc", 0, 8, 4)], name="handmade")
    attn = sf.auto.LayerGraph([sf.auto.Layer("a", "attention", (256, 192), None, (256, 64), 1.0,
                                        False, {"batch": 8, "heads": 5})], name="handmade")
    gpt = "sf.auto.model_graphs.gpt"
    e = "SearchInputError"
    cases = {
        "batch": (lambda: _gpt_graph(batch=-4),
                  f"{gpt}: batch must be a positive int, got -4; give batch=1 or more"),
        "d_model": (lambda: _gpt_graph(d_model=0),
                    f"{gpt}: d_model must be a positive int, got 0; give d_model=1 or more"),
        "heads": (lambda: _gpt_graph(heads=5),
                  f"{gpt}: heads=5 does not divide d_model=64 (each head takes d_model // heads "
                  f"of the width); give heads=4 or 8, or a d_model that heads divides"),
        "graph sizes": (lambda: sf.auto.search(bad_layer, c),
                        "search: layer 'fc' of handmade has input_shape (0, 8): every size "
                        "must be a positive int; build the graph from positive sizes (a "
                        "preset's batch, widths and lengths are 1 or more)"),
        "graph heads": (lambda: sf.auto.search(attn, c),
                        "search: attention layer 'a' of handmade: heads=5 does not divide "
                        "d_model=64 (each head takes d_model // heads of the width); give "
                        "heads=4 or 8, or a d_model that heads divides"),
        "micro_batches": (lambda: sf.auto.search(g, c, micro_batches=0),
                          "search: micro_batches must be an int >= 1 or 'auto' (the fewest "
                          "that fit memory), got 0; 1 means no gradient accumulation"),
        "algorithm": (lambda: sf.auto.search(g, c, algorithm="annealing"),
                      "search: unknown algorithm 'annealing'; give one of ['cd', 'enumerate', "
                      "'exhaustive', 'mh', 'random'] (cd: coordinate descent, the default)"),
        "budget_s": (lambda: sf.auto.search(g, c, budget_s=-1),
                     "search: budget_s must be a number of seconds >= 0 (or None: no cap), "
                     "got -1; e.g. budget_s=30"),
        "stages": (lambda: sf.auto.search(g, c, stages=0),
                   "search: stages must be 'auto', 'search' or an int >= 1 (1: no pipeline), "
                   "got 0"),
        "schedule": (lambda: sf.auto.search(g, c, stages=2, schedule="zb"),
                     "search: unknown schedule 'zb'; give one of ['1f1b', 'gpipe']"),
    }
    got = {name: _search_error(call) for name, (call, _) in cases.items()}
    assert got == {name: (e, text, True) for name, (_, text) in cases.items()}
    # the one-stage search checks alike (the module function, as the CLI's search reaches it)
    from sbpflow.auto.strategy_search import one_stage_search as one_stage
    assert _search_error(lambda: one_stage(g, c, budget_s=-1)) == got["budget_s"]


def _kib(n: float) -> str:
    return f"{n / 2 ** 10:.4g} KiB"


def test_a_result_over_the_memory_limit_warns_with_the_least_memory_any_strategy_needs():
    """No strategy fits 1000 bytes a device: the least-excess one is returned with a
    MemoryLimitWarning saying how much it needs, the least any one-stage strategy needs and
    what to allow (it came back without a word); a result that fits warns nothing."""
    g, c = _gpt_graph(), _cluster()
    with pytest.warns(sf.auto.MemoryLimitWarning) as record:
        r = sf.auto.search(g, c, memory_limit=1000, stages=1)
    floor = sf.auto.pipeline_search.one_stage_floor(g, c, 1)
    assert not r.fits and floor > 1000
    assert [str(w.message) for w in record] == [
        f"sf.auto.search: the strategy found needs {_kib(r.breakdown.memory['total'])} a "
        f"device, over the memory limit of 1000 B (no one-stage strategy at 1 micro-batch(es) "
        f"fits: the least any needs is {_kib(floor)}); it is returned anyway (result.fits is "
        f"False): allow zero=True, recompute=True, micro_batches='auto', stages='search', use "
        f"more devices or raise memory_limit"]
    assert issubclass(sf.auto.MemoryLimitWarning, RuntimeWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error", sf.auto.MemoryLimitWarning)
        assert sf.auto.search(g, c, stages=1).fits
