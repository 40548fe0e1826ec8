"""Memory accounting (issue 15, part 2): `memory_stats` gives each rank's bytes of parameters,
gradients and optimizer state exactly (formulas per layout, ZeRO stages included; each storage
once); `track` sees the tensors saved for backward and the parameters gathered for an op, per
rank thread (ZeRO-2 holds every gathered unit until backward, ZeRO-3 one at a time); and the
bytes agree with `sf.auto.evaluate`'s prediction for the same model and layout."""

import functools

import pytest
import torch

import sbpflow as sf
import sbpflow.memory as memory
from sbpflow.auto.space import Strategy, zero_twin
from sbpflow.auto.trace import trace
from sbpflow.models import gpt_class, layout, mlp_class

B, S = sf.B, sf.S
F32 = 4  # bytes of a float32

# (A 1-D S(0) parameter once kept its shard as a view of the whole tensor, and each rank held the
# whole storage; memory_stats counts storages, so the tp / row_split cases below catch that.)

# -- memory_stats: exact bytes per rank ----------------------------------------------------------
SIZES = (16, 32, 32, 8)   # W0 32x16, b0 32, W1 32x32, b1 32, W2 8x32, b2 8: 1864 elements
ALL = 512 + 32 + 1024 + 32 + 256 + 8
QUARTER = ALL // 4   # every size divides by 4
TP = 512 // 4 + 32 // 4 + 1024 // 4 + 32 + 256 // 4 + 8 // 4     # col, row (bias B), col
D2 = 512 // 2 + 32 // 2 + 1024 // 2 + 32 + 256 // 2 + 8 // 2     # (B, tp) on 2x2
# (params, grads, one optimizer state) elements per rank on 4 ranks
ELEMENTS = {"dp": (ALL,) * 3, "row_split": (QUARTER,) * 3, "tp": (TP,) * 3, "2d": (D2,) * 3,
            "zero1": (ALL, ALL, QUARTER),     # optimizer state split
            "zero2": (ALL, QUARTER, QUARTER),  # + gradients
            "zero": (QUARTER,) * 3}           # ZeRO-3: + parameters
BATCH = 8


def _mlp_step(name):
    sf.manual_seed(0)
    m = mlp_class(sf.nn, sf.nn.functional)(SIZES)
    lay = layout("mlp", name, sf.world_size())
    sf.parallel.apply(m, lay.placement, lay.rules, zero=lay.zero)
    opt = sf.optim.AdamW(m.parameters(), lr=1e-3)
    x = sf.tensor(torch.randn(BATCH, SIZES[0], generator=torch.Generator().manual_seed(1)),
                  lay.placement, lay.data_sbp)
    before = memory.memory_stats(m, opt)
    with memory.track() as mem:
        out = m(x)
        held = mem.current
        out.sum().backward()
    after_backward = memory.memory_stats(m, opt)
    opt.step()
    after_step = memory.memory_stats(m, opt)
    return dict(before=before, backward=after_backward, step=after_step, held=held,
                peak=mem.peak, by_kind=dict(mem.peak_by_kind), end=mem.current)


@functools.cache
def mlp_results(name):
    return sf.launch(_mlp_step, 4, args=(name,))


NAMES = ["dp", "tp", "row_split", "2d", "zero1", "zero2", "zero"]


@pytest.mark.parametrize("name", NAMES)
def test_grads_and_adamw_state_per_rank_are_the_formula(name):
    _, grads, state = (n * F32 for n in ELEMENTS[name])
    for r in mlp_results(name):
        assert r["before"]["grads"] == 0 and r["before"]["optimizer"] == 0
        assert r["backward"]["grads"] == grads and r["backward"]["optimizer"] == 0
        # AdamW: exp_avg + exp_avg_sq in the update layout; its step is an int (no bytes)
        assert r["step"]["grads"] == grads and r["step"]["optimizer"] == 2 * state
        s = r["step"]
        assert s["total"] == s["params"] + s["grads"] + s["optimizer"]


@pytest.mark.parametrize("name", NAMES)
def test_param_bytes_per_rank_are_the_formula(name):
    for r in mlp_results(name):
        for stage in ("before", "backward", "step"):
            assert r[stage]["params"] == ELEMENTS[name][0] * F32, stage


def test_zero_stages_hold_a_quarter_of_data_parallelism_for_what_they_shard():
    """On 4 ranks each ZeRO stage holds 1/4 (within 5 %) of data parallelism's bytes of what
    it shards, and data parallelism's of the rest."""
    dp = mlp_results("dp")[0]["step"]
    shards = {"zero1": ("optimizer",), "zero2": ("grads", "optimizer"),
              "zero": ("params", "grads", "optimizer")}
    for name, cats in shards.items():
        for r in mlp_results(name):
            for cat in ("params", "grads", "optimizer"):
                want = dp[cat] / 4 if cat in cats else dp[cat]
                assert r["step"][cat] == pytest.approx(want, rel=0.05), (name, cat)


def test_gathered_weights_zero2_none_zero3_one_unit():
    """ZeRO-2 keeps whole parameters (counted by memory_stats, not as gathered); ZeRO-3 frees
    the gathered weights after the unit's forward and gathers them again for its backward:
    one unit at a time (the MLP's units are its Linear layers; the largest is the 32x32 one
    with its bias). The saved activations are data parallelism's."""
    dp_saved = mlp_results("dp")[0]["by_kind"]["saved"]
    for r in mlp_results("zero2"):
        assert r["by_kind"] == {"saved": dp_saved, "gathered": 0}
        assert r["end"] == 0
    for r in mlp_results("zero"):
        assert r["by_kind"] == {"saved": dp_saved, "gathered": (1024 + 32) * F32}
        assert r["end"] == 0


def test_every_optimizer_state_tensor_is_counted():
    lin = sf.nn.Linear(6, 4)                       # 24 + 4 elements, one rank
    n = 28 * F32
    for opt, states in [(sf.optim.AdamW(lin.parameters(), amsgrad=True), 3),
                        (sf.optim.SGD(lin.parameters(), lr=0.1, momentum=0.9), 1),
                        (sf.optim.SGD(lin.parameters(), lr=0.1), 0)]:
        lin(sf.randn(3, 6)).sum().backward()
        opt.step()
        got = memory.memory_stats(lin, opt)
        assert got == {"params": n, "grads": n, "optimizer": states * n,
                       "total": (2 + states) * n}
        opt.zero_grad()
        assert memory.memory_stats(lin, opt)["grads"] == 0


# -- each storage once ---------------------------------------------------------------------------
class _Opt:
    """The two attributes memory_stats reads of an optimizer."""

    def __init__(self, params, state):
        self.param_groups = [{"params": params}]
        self.state = state


def test_shared_storage_is_counted_once():
    t = sf.randn(4, 4)
    p1, p2 = sf.nn.Parameter(t), sf.nn.Parameter(t)   # two parameters, one storage
    assert p1.local.data_ptr() == p2.local.data_ptr()
    assert memory.memory_stats([p1, p2, p1])["params"] == 16 * F32
    # a module with a tied weight: counted once
    m = sf.nn.Sequential(sf.nn.Linear(4, 4, bias=False), sf.nn.Linear(4, 4, bias=False))
    m[1].weight = m[0].weight
    assert memory.memory_stats(m)["params"] == 16 * F32
    # gradients that are views of one flat buffer count the buffer, once
    flat = torch.zeros(40)
    p1.local.grad = flat[:16].view(4, 4)
    q = sf.nn.Parameter(sf.randn(4, 4))
    q.local.grad = flat[16:32].view(4, 4)
    got = memory.memory_stats([p1, q])
    assert got["params"] == 32 * F32 and got["grads"] == 40 * F32
    # a state tensor that is a gradient's storage was counted as a gradient already; a
    # GlobalTensor state and a torch one both count
    opt = _Opt([p1, q], {q: {"a": flat[32:], "b": sf.zeros(5), "step": 3}})
    got = memory.memory_stats(optimizer=opt)
    assert got == {"params": 32 * F32, "grads": 40 * F32, "optimizer": 5 * F32,
                   "total": 77 * F32}


def test_empty_shards_and_meta_parameters_hold_nothing():
    with sf.nn.init.meta_init():
        m = sf.nn.Linear(8, 8)
    assert memory.memory_stats(m) == {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    assert memory.memory_stats() == {"params": 0, "grads": 0, "optimizer": 0, "total": 0}


# -- track: tensors saved for backward --------------------------------------------------------
def _torch_mlp():
    g = torch.Generator().manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(b, a, generator=g))
        layers += [lin] + ([torch.nn.ReLU()] if i < len(SIZES) - 2 else [])
    return torch.nn.Sequential(*layers)


def test_track_counts_the_inputs_of_each_linear_and_relu_outputs_plain_torch():
    m = _torch_mlp()
    x = torch.randn(BATCH, SIZES[0])
    with memory.track() as mem:
        out = m(x)
        held = mem.current
        out.sum().backward()
    # saved: x (the first Linear's input), each ReLU's output (which is also the next Linear's
    # input: one storage); the weights are parameters, not counted; sum saves nothing
    want = BATCH * (SIZES[0] + SIZES[1] + SIZES[2]) * F32
    assert held == want and mem.peak == want and mem.peak_by_kind == {"saved": want,
                                                                      "gathered": 0}
    assert mem.current == 0            # backward released every saved tensor
    assert mem.cuda_max_allocated is None


@pytest.mark.parametrize("name", ["dp", "tp"])
def test_track_peak_of_the_mlp_per_rank_is_the_formula(name):
    b, (d0, d1, d2, _) = BATCH, SIZES
    if name == "dp":   # rows split in 4: x, the two ReLU outputs
        want = b // 4 * (d0 + d1 + d2) * F32
    else:
        # x whole; the first ReLU's output split on features; the row-parallel layer's
        # partial output is reduce-scattered over rows before its ReLU (ReLU saves that quarter)
        # and all-gathered again as the last, column-parallel layer's input
        want = (b * d0 + b * d1 // 4 + b // 4 * d2 + b * d2) * F32
    for r in mlp_results(name):
        assert r["held"] == want and r["peak"] == want
        assert r["by_kind"] == {"saved": want, "gathered": 0}
        assert r["end"] == 0


def _gathered():
    pl = sf.placement("cpu", [0, 1])
    w1 = sf.nn.Parameter(sf.randn(32, 16, placement=pl, sbp=B, seed=1))
    w2 = sf.nn.Parameter(sf.randn(8, 32, placement=pl, sbp=S(0), seed=2))   # stored split
    x = sf.randn(4, 16, placement=pl, sbp=B, seed=3)
    with memory.track() as mem:
        h = sf.nn.functional.relu(sf.nn.functional.linear(x, w1))
        y = sf.nn.functional.linear(h, w2.to_global(sbp=B))   # gathered for the op
        held = (mem.current, dict(mem.current_by_kind))
        y.sum().backward()
    return held, mem.peak, dict(mem.peak_by_kind), mem.current


def test_a_parameter_gathered_for_an_op_counts_as_gathered():
    saved = (4 * 16 + 4 * 32) * F32   # x; the ReLU output (the second linear's input)
    gathered = 8 * 32 * F32           # the whole w2, kept for backward
    for held, peak, by_kind, end in sf.launch(_gathered, 2):
        assert held == (saved + gathered, {"saved": saved, "gathered": gathered})
        assert peak == saved + gathered and by_kind == {"saved": saved, "gathered": gathered}
        assert end == 0


def _isolated():
    r = sf.rank()
    comm = sf.comm.current()
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn((r + 1) * 8, 64)                    # a different size on every rank
    pl = sf.placement("cpu", [0, 1, 2, 3])
    g = sf.randn(10, 64, placement=pl, sbp=S(0), seed=0).requires_grad_()   # rows 3, 3, 2, 2
    with memory.track() as mem:
        comm.barrier()                                  # every rank tracks at once
        y = torch.relu(x @ w)
        z = sf.nn.functional.relu(g) * 2.0
        comm.barrier()
        peak = mem.peak
        (y.sum() + z.sum().to_local().sum()).backward()
        comm.barrier()
    return peak, g.local.shape[0], mem.current


def test_each_rank_thread_sees_only_its_own_tensors():
    res = sf.launch(_isolated, 4)
    for r, (peak, rows, end) in enumerate(res):
        # x and relu(x @ w): (r + 1) * 8 rows of 64; the global relu's output: its own rows
        assert peak == (2 * (r + 1) * 8 * 64 + rows * 64) * F32, r
        assert end == 0
    assert [rows for _, rows, _ in res] == [3, 3, 2, 2]


def test_nested_trackers_both_count():
    x = torch.randn(5, 7)
    w = torch.randn(7, 3, requires_grad=True)
    with memory.track() as outer:
        a = torch.relu(x @ w)
        with memory.track() as inner:
            b = torch.sigmoid(a)
        assert inner.peak == 5 * 3 * F32                      # sigmoid's output
        assert outer.current == (5 * 7 + 5 * 3 + 5 * 3) * F32  # x, relu out, sigmoid out
        b.sum().backward()
    assert outer.current == 0 and inner.current == 0


def test_attach_counts_what_another_thread_saves_for_this_rank():
    import threading
    x = torch.randn(6, 5)
    w = torch.randn(5, 3, requires_grad=True)
    out = {}

    def work(trackers):
        with memory.attach(trackers):
            out["y"] = torch.relu(x @ w)           # saves x and relu's output
        out["z"] = torch.relu(x @ w)                # outside attach: not seen

    with memory.track() as mem:
        t = threading.Thread(target=work, args=(memory.active_trackers(),))
        t.start()
        t.join()
    assert mem.peak == mem.current == (6 * 5 + 6 * 3) * F32
    out["y"].sum().backward()
    assert mem.current == 0


class _Step(sf.nn.Graph):
    def __init__(self, model, opt):
        super().__init__()
        self.model = model
        self.add_optimizer(opt)

    def build(self, x):
        loss = self.model(x).sum()
        loss.backward()
        return loss


def _graph_peaks():
    pl = sf.placement("cpu", [0, 1])
    sf.manual_seed(0)
    m = mlp_class(sf.nn, sf.nn.functional)(SIZES)
    sf.parallel.apply(m, pl, {"*": B})
    step = _Step(m, sf.optim.AdamW(m.parameters()))
    peaks = []
    for i in range(2):   # the first call traces build eagerly, the second replays the plan
        x = sf.tensor(torch.randn(BATCH, SIZES[0], generator=torch.Generator().manual_seed(i)),
                      pl, S(0))
        with memory.track() as mem:
            step(x)
        peaks.append(mem.peak)
    return peaks


def test_a_graph_replay_is_tracked_like_eager():
    want = BATCH // 2 * (SIZES[0] + SIZES[1] + SIZES[2]) * F32
    for peaks in sf.launch(_graph_peaks, 2):
        assert peaks == [want, want]


# -- agreement with the cost model (sf.auto.evaluate) ----------------------------------------
GPT = dict(vocab=64, d=64, heads=4, layers=2, seq=16)
GPT_BATCH = 8


def _gpt_inputs():
    g = torch.Generator().manual_seed(7)
    tok = torch.randint(0, GPT["vocab"], (GPT_BATCH, GPT["seq"] + 1), generator=g)
    return [tok[:, :-1].contiguous(), torch.arange(GPT["seq"]), tok[:, 1:].contiguous()]


def _strategy(graph, cluster, name):
    """The strategy of layout ``name``: ``dp``, ``tp`` (Megatron, tp 4) or ``2d`` (dp 2 x tp
    2), each optionally with ``-zero1`` / ``-zero2`` / ``-zero3``: that ZeRO stage along the
    data-parallel dims of every weight (`sbpflow.auto.space.zero_twin`)."""
    base, _, zero = name.partition("-zero")
    if base == "dp":
        strategy = sf.auto.baselines.data_parallel(graph, cluster)
    else:
        strategy = sf.auto.baselines.megatron(graph, cluster, tp=4 if base == "tp" else 2)
    if not zero:
        return strategy
    return Strategy(graph, [zero_twin(l, s, int(zero)) for l, s in
                            zip(graph.layers, strategy.layers)])


def _gpt_step(name, dtype=torch.float32):
    """Lay out the GPT by sf.auto.parallelize with the strategy of ``name`` (`_strategy`),
    run one AdamW step and return the measured bytes and evaluate's prediction for the same
    strategy."""
    sf.manual_seed(0)
    m = gpt_class(sf.nn, sf.nn.functional)(**GPT)
    if dtype != torch.float32:
        m.to(dtype)
    cluster = sf.cost.Cluster.preset("dgx-a100", nodes=1, devices_per_node=4)
    pl = sf.placement("cpu", [0, 1, 2, 3])
    graph, modules = trace(m, _gpt_inputs())
    strategy = _strategy(graph, cluster, name)
    plan = sf.auto.parallelize(m, _gpt_inputs(), pl, cluster, strategy=strategy)
    args = [plan.input(v) for v in _gpt_inputs()]
    predicted = dict(sf.auto.evaluate(graph, strategy, cluster).memory)
    # the graph's layers are the traced Linear / Embedding modules: their weights are what
    # evaluate counts; biases and norms are not in the graph
    weights = [modules[l.name].weight for l in graph.layers]
    ids = {id(w) for w in weights}
    opt_w = sf.optim.AdamW(weights, lr=1e-3)
    opt_rest = sf.optim.AdamW([p for p in m.parameters() if id(p) not in ids], lr=1e-3)
    m(*args).backward()
    opt_w.step()
    opt_rest.step()
    return dict(weights=memory.memory_stats(weights, opt_w),
                model=memory.memory_stats(m, [opt_w, opt_rest]), predicted=predicted,
                stages={s.zero for s in strategy.layers})


@functools.cache
def gpt_results(name, dtype=torch.float32):
    return sf.launch(_gpt_step, 4, args=(name, dtype))


LAYOUTS = ["dp", "tp", "2d"] + [f"{b}-zero{z}" for b in ("dp", "2d") for z in (1, 2, 3)]
AGREE = [(name, cat) for name in LAYOUTS for cat in ("params", "grads", "optimizer")]


@pytest.mark.parametrize("name,category", AGREE, ids=[f"{n}-{c}" for n, c in AGREE])
def test_measured_bytes_agree_with_evaluate(name, category):
    """evaluate's params / grads / optimizer per device count the weights of the graph's
    layers (the traced modules) in their stored layout: float32, AdamW's two states; at ZeRO
    stage 1 the optimizer state split, at 2 also the gradient, at 3 also the weight. So the
    measured bytes of exactly those weights equal it; the whole model (plus biases and norm
    weights, which the graph leaves out) is within 10 % above it."""
    stage = int(name[-1]) if "-zero" in name else 0
    for r in gpt_results(name):
        assert stage in r["stages"]   # the strategy has layers at that stage
        want = r["predicted"][category]
        assert r["weights"][category] == pytest.approx(want, rel=1e-9)
        assert want <= r["model"][category] <= 1.10 * want


def test_evaluate_splits_what_each_zero_stage_splits():
    """On 4 data-parallel ranks every stage holds a quarter of data parallelism's bytes of
    what it splits and all of the rest (the prediction, exactly)."""
    dp = gpt_results("dp")[0]["predicted"]
    split = {1: ("optimizer",), 2: ("grads", "optimizer"), 3: ("params", "grads", "optimizer")}
    for stage, cats in split.items():
        got = gpt_results(f"dp-zero{stage}")[0]["predicted"]
        for cat in ("params", "grads", "optimizer"):
            assert got[cat] == pytest.approx(dp[cat] / 4 if cat in cats else dp[cat]), \
                (stage, cat)


def test_float64_optimizer_state_agrees_with_evaluate():
    """A traced float64 model: AdamW keeps its two states in float64, and evaluate prices them
    so (the graph's optimizer_itemsize is the parameters' dtype)."""
    for r in gpt_results("dp", torch.float64):
        assert r["weights"]["optimizer"] == pytest.approx(r["predicted"]["optimizer"], rel=1e-9)
        assert r["weights"]["params"] == pytest.approx(r["predicted"]["params"], rel=1e-9)
