"""The DataLoader as a graph's data source: ``loader()`` in ``build`` is a loading actor that
gives one batch a call, cut into the call's micro-batches. Training with it equals one-device
torch on the same batches (torch's own sampler order), across an epoch boundary, for 1 and 3
micro-batches; the timeline has the loading actor; a batch of another shape is refused."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

import sbpflow as sf

G = torch.Generator().manual_seed(0)
XS = torch.randn(40, 6, generator=G, dtype=torch.float64)
YS = torch.randint(0, 3, (40,), generator=G)
W0 = torch.randn(3, 6, generator=G, dtype=torch.float64)
BATCH, STEPS, SEED = 12, 5, 3   # 3 batches an epoch: 5 steps cross into epoch 1


def torch_losses() -> list[float]:
    """One device: torch's sampler order (seed + epoch), SGD on the whole batch."""
    w = W0.clone().requires_grad_(True)
    opt = torch.optim.SGD([w], lr=0.5)
    losses, epoch = [], 0
    while len(losses) < STEPS:
        sampler = torch.utils.data.DistributedSampler(TensorDataset(XS, YS), num_replicas=1,
                                                      rank=0, shuffle=True, seed=SEED)
        sampler.set_epoch(epoch)
        order = list(sampler)
        for b in range(len(order) // BATCH):
            idx = order[b * BATCH:(b + 1) * BATCH]
            loss = torch.nn.functional.cross_entropy(XS[idx] @ w.T, YS[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) == STEPS:
                break
        epoch += 1
    return losses


class Named(torch.utils.data.Dataset):
    """XS, YS as dict items ``{"x", "y"}``."""

    def __len__(self) -> int:
        return len(XS)

    def __getitem__(self, i: int) -> dict:
        return {"x": XS[i], "y": YS[i]}


def _graph_run(micro_batches: int, workers: int = 0, items: str = "tuple"):
    pl = sf.placement("cpu", [0, 1])
    ds = Named() if items == "dict" else TensorDataset(XS, YS)
    loader = sf.data.DataLoader(ds, BATCH, pl, sbp=sf.S(0), seed=SEED, workers=workers)
    lin = sf.nn.Linear(6, 3, bias=False, dtype=torch.float64)
    lin.weight = sf.nn.Parameter(sf.tensor(W0, pl, sf.B))
    opt = sf.optim.SGD(lin.parameters(), lr=0.5)

    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = lin
            self.add_optimizer(opt)
            self.config.set_gradient_accumulation_steps(micro_batches)

        def build(self):
            batch = loader()
            x, y = (batch["x"], batch["y"]) if items == "dict" else batch
            loss = sf.nn.functional.cross_entropy(self.lin(x), y)
            loss.backward()
            return loss

    step = Step()
    losses = [step().item() for _ in range(STEPS)]
    kinds = {e["actor"]: e["kind"] for e in step.timeline()}
    loader.close()
    return losses, kinds, loader.epoch


@pytest.mark.parametrize("micro_batches,workers,items",
                         [(1, 0, "tuple"), (3, 0, "tuple"), (3, 1, "tuple"), (3, 0, "dict")])
def test_graph_with_loader_equals_torch(micro_batches, workers, items):
    want = torch_losses()
    for losses, kinds, epoch in sf.launch(_graph_run, world_size=2,
                                          args=(micro_batches, workers, items)):
        assert losses == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert kinds["load"] == "load"
        assert epoch == 1


def _changed_batch():
    pl = sf.placement("cpu", [0, 1])
    # 30 rows, batches of 12 without drop_last: the third batch has 6 rows
    loader = sf.data.DataLoader(TensorDataset(XS[:30], YS[:30]), BATCH, pl, sbp=sf.S(0),
                                drop_last=False)
    lin = sf.nn.Linear(6, 3, bias=False, dtype=torch.float64)

    class Step(sf.nn.Graph):
        def __init__(self):
            super().__init__()
            self.lin = lin

        def build(self):
            x, _ = loader()
            return self.lin(x).sum()

    step = Step()
    step()
    step()
    step()


def test_a_batch_of_another_shape_is_refused():
    # each rank's loading actor refuses it; the caller gets the first one's GraphError
    with pytest.raises(sf.GraphError, match="drop_last=True"):
        sf.launch(_changed_batch, world_size=2)
