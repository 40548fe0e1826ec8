"""A trainer measures what a rank holds (`sf.memory.track`'s saved-tensor hooks for
``peak_activation_bytes``, the parameter-bytes samples for ``peak_param_bytes``) only in the
runs whose plan and batch shapes it has not measured yet (`parallel/cdp/window_measure.py`;
with peers, the parameter bytes in every run): the same parameters, losses and stats as
measuring every run (with peers, but the parameter bytes), no hook in the steady state,
measuring again for new batch shapes, after a stage ran its module, for stages that never
replay fixed kernels and inside a caller's `sf.memory.track` block (docs/cdp.md, 'Stats')."""

import pytest
import torch

import sbpflow as sf
import sbpflow.memory as memory
from cdp_fns import F64, WIDTH, CLASSES, loss_fn, make_stages, sgd
from sbpflow.parallel.cdp import CyclicDataParallel, ranks_needed, rules
from sbpflow.parallel.cdp.rank_state import RankState
from sbpflow.parallel.cdp.window_measure import WindowMeasure

N = 3


def _batches(sizes: list[int]) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(b, WIDTH, dtype=F64, generator=g),
             torch.randint(0, CLASSES, (b,), generator=g)) for b in sizes]


def _counting_hooks(monkeypatch) -> dict:
    """Counts the saved-tensor hook's calls, per rank."""
    packs: dict = {}
    real = memory._pack

    def counted(t):
        r = sf.rank()
        packs[r] = packs.get(r, 0) + 1
        return real(t)
    monkeypatch.setattr(memory, "_pack", counted)
    return packs


def _train(mode: str, rule: str, sizes: list[int], always: bool, packs: dict,
           stages=None, between=None) -> dict:
    """Steps over batches of ``sizes``; the hooks' calls of this rank during each step;
    ``between(trainer, step)`` runs before each step."""
    t = CyclicDataParallel(stages or make_stages(N), loss_fn, sgd, rule=rule, mode=mode)
    if t.state is not None and always:
        t.measuring = WindowMeasure(always=True)
    r = sf.rank()
    losses, per_step = [], []
    for k, (x, y) in enumerate(_batches(sizes)):
        if between is not None:
            between(t, k)
        before = packs.get(r, 0)
        losses += t.step(x, y)
        per_step.append(packs.get(r, 0) - before)
    losses += t.flush()
    return {"state": t.state_dict(), "losses": losses, "stats": t.stats(),
            "packs": per_step}


# with peers, what a rank holds of parameters depends on when versions arrive: it differs
# between two runs measured throughout, and every run samples it
_TIMED = ("peak_param_bytes", "param_bytes_by_rank")


def _counting_samples(monkeypatch) -> dict:
    """Counts the parameter-bytes samples, per rank."""
    samples: dict = {}
    real = RankState.param_bytes

    def counted(self):
        samples[self.rank] = samples.get(self.rank, 0) + 1
        return real(self)
    monkeypatch.setattr(RankState, "param_bytes", counted)
    return samples


def _both(monkeypatch, mode: str, rule: str, sizes: list[int], **kw) -> tuple[list, list]:
    packs = _counting_hooks(monkeypatch)
    world = ranks_needed(mode, N, rules.timeline_of(rule))
    runs = [sf.launch(lambda a=a: _train(mode, rule, sizes, a, packs, **kw), world_size=world)
            for a in (False, True)]
    timed = _TIMED if world > 1 else ()
    for got, want in zip(*runs):
        assert set(got["state"]) == set(want["state"])
        for k in want["state"]:
            assert torch.equal(got["state"][k], want["state"][k]), k
        assert got["losses"] == want["losses"]
        assert {k: v for k, v in got["stats"].items() if k not in timed} == \
            {k: v for k, v in want["stats"].items() if k not in timed}
    return runs


@pytest.mark.parametrize("mode,rule", [("single", "v2"), ("single", "dp"), ("dp", "v2"),
                                       ("pp", "v1"), ("zero", "v2")])
def test_steady_runs_are_not_measured_and_the_stats_are_the_same(monkeypatch, mode, rule):
    default, every = _both(monkeypatch, mode, rule, [2 * N] * 8)
    for got, want in zip(default, every):
        if got["state"] and sum(want["packs"]):  # (a rank that saves tensors)
            assert got["packs"][-3:] == [0, 0, 0]
            assert min(want["packs"][-3:]) > 0
    assert default[0]["stats"]["peak_activation_bytes"] > 0


@pytest.mark.parametrize("mode,rule", [("single", "v2"), ("dp", "v2"), ("zero", "v2")])
def test_parameter_bytes_are_sampled_every_run_with_peers(monkeypatch, mode, rule):
    samples = _counting_samples(monkeypatch)
    world = ranks_needed(mode, N, rules.timeline_of(rule))
    counts = []
    for always in (False, True):
        samples.clear()
        res = sf.launch(lambda: _train(mode, rule, [2 * N] * 8, always, {}), world_size=world)
        counts.append(dict(samples))
        assert res[0]["stats"]["peak_param_bytes"] > 0
    if world > 1:
        assert counts[0] == counts[1]   # every run sampled, as when measuring throughout
    else:
        assert 0 < counts[0][0] < counts[1][0]   # the steady runs did not


def test_new_batch_shapes_are_measured_again(monkeypatch):
    # the larger batches from step 5 on: their peak is the trainer's
    default, every = _both(monkeypatch, "single", "v2", [2 * N] * 5 + [4 * N] * 5)
    packs = default[0]["packs"]
    assert packs[3:5] == [0, 0] and packs[5] > 0 and packs[-2:] == [0, 0]


def test_a_stage_that_runs_its_module_is_measured_every_run(monkeypatch):
    def hooked():  # a forward hook: the stage never replays its kernels
        stages = make_stages(N)
        stages[1].register_forward_hook(lambda module, args, out: None)
        return stages
    default, _ = _both(monkeypatch, "single", "v2", [2 * N] * 6, stages=hooked())
    assert min(default[0]["packs"]) > 0


def test_a_switch_to_eval_is_measured_again(monkeypatch):
    def to_eval(t, k):
        if k == 5:
            for r in t.runners:
                r.module.eval()
    default, _ = _both(monkeypatch, "single", "v2", [2 * N] * 9, between=to_eval)
    packs = default[0]["packs"]
    # step 5's forwards in eval mode run their modules once (measured on their own), and
    # the runs after are measured until one of them is measured from a measured start
    assert packs[3:5] == [0, 0] and packs[5] > 0 and packs[6] > 0 and packs[-1] == 0


def test_a_callers_memory_track_block_sees_every_run():
    def fn():
        t = CyclicDataParallel(make_stages(N), loss_fn, sgd, rule="v2", mode="single")
        data = _batches([2 * N] * 6)
        for x, y in data[:4]:
            t.step(x, y)
        with sf.memory.track() as mem:
            t.step(*data[4])
        return mem.peak
    assert sf.launch(fn, world_size=1)[0] > 0
