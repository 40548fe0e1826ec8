"""CDP stages with buffers (issue 16): batch norm's running statistics are part of a stage's
version. A micro-batch's forward changes a copy of its version's buffers; the update adds the
mean of the N micro-batches' changes to the latest version's buffers. Checked against that
rule in plain torch, and every setting bit-for-bit against the closed form."""

import pytest
import torch

import sbpflow as sf
from cdp_fns import CLASSES, F64, LR, MOMENTUM, WIDTH, batches, loss_fn, sgd
from sbpflow.parallel.cdp import CyclicDataParallel, closed_form, ranks_needed, rules

N, HIDDEN, BN_MOMENTUM = 3, 6, 0.1


@pytest.fixture(autouse=True)
def _bounded_waits(monkeypatch):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "60")  # a hang fails naming its actor


def _stages() -> list:
    sf.manual_seed(0)
    return [sf.nn.Sequential(sf.nn.Linear(WIDTH, HIDDEN, dtype=F64),
                             sf.nn.BatchNorm1d(HIDDEN, momentum=BN_MOMENTUM, dtype=F64),
                             sf.nn.Tanh()),
            sf.nn.Sequential(sf.nn.Linear(HIDDEN, WIDTH, dtype=F64), sf.nn.Tanh()),
            sf.nn.Linear(WIDTH, CLASSES, dtype=F64)]


def _reference(rule: str) -> dict:
    return sf.launch(lambda: closed_form(_stages(), loss_fn, sgd, rule, batches(N)),
                     world_size=1)[0][0]


def _torch_rule(rule: str) -> dict:
    """The rule in plain torch: versions of (parameters, running mean, running var, count);
    each micro-batch normalises with its own statistics and changes a copy of its version's
    running statistics; the update adds the mean change to the latest version."""
    first = sf.launch(lambda: {f"{j}.{k}": v.detach().clone() for j, s in enumerate(_stages())
                               for k, v in s.state_dict().items()}, world_size=1)[0]
    hist = {0: dict(first)}
    bufs: dict = {}
    for c, (x, y) in enumerate(batches(N)):
        total: dict = {}
        for i, (xi, yi) in enumerate(zip(torch.tensor_split(x, N), torch.tensor_split(y, N))):
            v = [hist[rules.version(rule, c, i, j, N)] for j in range(N)]
            p = {k: v[int(k[0])][k].detach().clone() for k in first}
            for k, t in p.items():
                t.requires_grad_(k.endswith(("weight", "bias")))
            h = xi @ p["0.0.weight"].T + p["0.0.bias"]
            h = torch.tanh(torch.nn.functional.batch_norm(
                h, p["0.1.running_mean"], p["0.1.running_var"], p["0.1.weight"], p["0.1.bias"],
                training=True, momentum=BN_MOMENTUM))
            p["0.1.num_batches_tracked"] += 1
            h = torch.tanh(h @ p["1.0.weight"].T + p["1.0.bias"])
            loss = torch.nn.functional.cross_entropy(h @ p["2.weight"].T + p["2.bias"], yi)
            loss.backward()
            for k, t in p.items():
                d = t.grad if t.requires_grad else t - v[int(k[0])][k]
                total[k] = d if k not in total else total[k] + d
        new = {}
        for k, t in hist[c].items():
            if k in bufs or t.is_floating_point() and k.endswith(("weight", "bias")):
                g = total[k] / N
                bufs[k] = g if k not in bufs else MOMENTUM * bufs[k] + g
                new[k] = t - LR * bufs[k]
            else:
                step = total[k] / N if t.is_floating_point() else total[k] // N
                new[k] = t + step
        hist[c + 1] = new
    return hist[len(batches(N))]


@pytest.mark.parametrize("rule", ["dp", "v2"])
def test_closed_form_with_batch_norm_is_the_rule_in_plain_torch(rule):
    got, want = _reference(rule), _torch_rule(rule)
    assert set(got) == set(want) and "0.1.running_var" in got
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-10, atol=1e-12, msg=k)
    assert int(got["0.1.num_batches_tracked"]) == len(batches(N))


@pytest.mark.parametrize("mode,rule", [("single", "v2"), ("dp", "v1"), ("pp", "dp"),
                                       ("zero", "v2"), ("mp", "v2")])
def test_settings_with_batch_norm_equal_the_closed_form(mode, rule):
    def fn():
        t = CyclicDataParallel(_stages(), loss_fn, sgd, rule=rule, mode=mode)
        data = batches(N)
        for x, y in data[:3]:
            t.step(x, y)
        t.flush()
        t.step(*data[3])
        t.flush()
        return t.state_dict()
    world = ranks_needed(mode, N, rules.timeline_of(rule))
    res = sf.launch(fn, world_size=world)
    want = _reference(rule)
    for r in res:
        assert set(r) == set(want)
        for k in want:
            assert torch.equal(r[k], want[k]), k
