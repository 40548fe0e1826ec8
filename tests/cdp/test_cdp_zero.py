"""CDP's ZeRO setting (issue 16): stage j's parameters live on rank j and are relayed
point-to-point i -> i+1 as the workers reach F_j and again as they reach B_j (a worker frees
its copy after F_j). Checked: bit-for-bit the closed-form rule, the messages and bytes per
step against their formula, and the parameter bytes each rank held against the bound the
relays imply (docs/cdp.md, 'Settings')."""

import time

import pytest
import torch

import sbpflow as sf
from sbpflow.parallel.cdp import CyclicDataParallel, closed_form

F64 = torch.float64
N, WIDTH, MB, STEPS = 5, 16, 4, 4
STAGE_BYTES = (WIDTH * WIDTH + WIDTH) * 8   # every stage: Linear(16, 16) in float64


@pytest.fixture(autouse=True)
def _bounded_waits(monkeypatch):
    monkeypatch.setenv("SBPFLOW_TIMEOUT", "60")  # a hang fails naming its actor


def _stages() -> list:
    sf.manual_seed(0)
    return [sf.nn.Sequential(sf.nn.Linear(WIDTH, WIDTH, dtype=F64), sf.nn.Tanh())
            for _ in range(N)]


def _loss(out, y):
    return ((out - y) ** 2).mean()


def _sgd(params):
    return sf.optim.SGD(params, lr=0.05, momentum=0.9)


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(N * MB, WIDTH, dtype=F64, generator=g),
             torch.randn(N * MB, WIDTH, dtype=F64, generator=g)) for _ in range(STEPS)]


def _train(rule: str) -> dict:
    t = CyclicDataParallel(_stages(), _loss, _sgd, rule=rule, mode="zero")
    sf.comm.reset_stats()
    for x, y in _batches():
        t.step(x, y)
    t.flush()
    p2p = sf.comm.stats().kinds["p2p"]  # the communicator's own count, before the collectives
    return {"state": t.state_dict(), "stats": t.stats(), "sent": p2p.sent, "calls": p2p.calls}


@pytest.mark.parametrize("rule", ["dp", "v1", "v2"])
def test_zero_relays_at_forward_and_backward(rule):
    want, _ = sf.launch(lambda: closed_form(_stages(), _loss, _sgd, rule, _batches()),
                        world_size=1)[0]
    res = sf.launch(lambda: _train(rule), world_size=N)
    for k in want:
        assert torch.equal(res[0]["state"][k], want[k]), k
    st = res[0]["stats"]
    # per stage and step: a copy to each of the N-1 other workers for F_j, again for B_j
    # (not the last stage: its B_j follows its F_j, the copy is kept), and the N-1 hops of
    # the gradient sum to the owner plus one from the last worker (not for the last stage:
    # its owner is the last worker)
    messages = N * (N - 1) + (N - 1) * (N - 1) + N * (N - 1) + (N - 1)
    assert messages == 3 * N * (N - 1)
    assert st["messages_per_step"] == messages
    assert st["bytes_per_step"] == messages * STAGE_BYTES
    # sf.comm.stats: every message is one exchange call on its sender and one on its receiver
    assert sum(r["sent"] for r in res) == STEPS * messages * STAGE_BYTES
    assert sum(r["calls"] for r in res) == 2 * STEPS * messages
    # a rank holds its stage's versions and momentum, and at most 3 relayed copies: the one
    # its op uses and those arriving for its next two ops. Keeping each copy from F_j to B_j
    # (as before) holds N - 1 = 4 of them at the turn of a cycle. At least: its most versions
    # at once, or one version, the momentum and a relayed copy (whether a copy arrives while
    # the rank holds two versions depends on the threads' timing)
    versions = st["max_versions"]
    for r, held in st["param_bytes_by_rank"].items():
        owned = (versions[r] + 1) * STAGE_BYTES
        least = max(owned, 3 * STAGE_BYTES)
        assert least <= held <= owned + 3 * STAGE_BYTES, (r, held / STAGE_BYTES)




def test_a_send_still_copying_a_version_sends_it_as_it_was(monkeypatch):
    """The owner's update writes into a version whose last read was taken (`unused`); a
    send of the version (on a thread of its own) takes its read only once its copy is made,
    or the receiver gets the updated tensors. Here each of the owners' sends for a backward
    waits 20 ms between reading the version and the copy: under v2, a stale version's
    sends then overlap the update that follows it (it failed so every time)."""
    from sbpflow.parallel.cdp import rank_state
    tensors = rank_state.RankState._tensors

    def slow(self, t):
        out = tensors(self, t)
        if t.payload[0] == "paramb" and not self._relayed(t.payload[1]):
            time.sleep(0.02)
        return out

    monkeypatch.setattr(rank_state.RankState, "_tensors", slow)
    want, _ = sf.launch(lambda: closed_form(_stages(), _loss, _sgd, "v2", _batches()),
                        world_size=1)[0]
    got = sf.launch(lambda: _train("v2"), world_size=N)[0]["state"]
    for k in want:
        assert torch.equal(got[k], want[k]), k
