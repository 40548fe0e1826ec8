"""Module-aware rule values (`sf.parallel.colwise` / `rowwise` / `replicate`): each resolves to
the split of its module's weight axes (nn.Linear (out, in), nn.Embedding (num, dim), a
convolution (out, in, ...) or transposed (in, out, ...)), on the chosen mesh dim; a model laid
out by them trains as torch on one device (float64)."""

import copy

import pytest
import torch
import torch.nn as nn

import sbpflow as sf

F64 = torch.float64
S, B = sf.S, sf.B


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(8, 12, (3, 1), padding=(1, 0))
        self.up = nn.Linear(12, 16)
        self.down = nn.Linear(16, 4)

    def forward(self, ids):                                   # ids (N, L)
        h = self.emb(ids).transpose(1, 2).unsqueeze(-1)       # (N, 8, L, 1)
        h = self.conv(h).squeeze(-1).transpose(1, 2)          # (N, L, 12)
        return self.down(torch.relu(self.up(h))).square().mean()


RULES = {"emb.*": sf.parallel.rowwise, "conv.*": sf.parallel.colwise,
         "up.*": sf.parallel.colwise, "down.*": sf.parallel.rowwise,
         "deconv.*": sf.parallel.colwise(mesh_dim=0), "*": sf.parallel.replicate}


def test_styles_resolve_to_each_modules_axes_on_the_chosen_dim():
    torch.manual_seed(0)
    model = Net().to(F64)
    model.deconv = nn.ConvTranspose2d(4, 6, 3)                # weight (in, out, kH, kW)
    names = [n for n, _ in model.named_parameters()]
    got = sf.parallel.match_rules(names, RULES, sf.placement("cpu", [[0, 1], [2, 3]]), model)
    assert got == {"emb.weight": (B, S(0)), "conv.weight": (B, S(0)), "conv.bias": (B, S(0)),
                   "up.weight": (B, S(0)), "up.bias": (B, S(0)),
                   "down.weight": (B, S(1)), "down.bias": (B, B),
                   "deconv.weight": (S(1), B), "deconv.bias": (S(0), B)}
    with pytest.raises(sf.SbpError, match="needs the model"):
        sf.parallel.match_rules(names, RULES, sf.placement("cpu", [0, 1]))
    with pytest.raises(sf.SbpError, match="mesh_dim=2 is not a dim"):
        sf.parallel.match_rules(names, {"*": sf.parallel.colwise(mesh_dim=2)},
                                sf.placement("cpu", [[0, 1], [2, 3]]), model)


def _steps(model, ids, steps=2):
    ns = sf.optim if isinstance(model, sf.nn.Module) else torch.optim
    opt = ns.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model(ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_a_model_laid_out_by_styles_trains_as_torch():
    torch.manual_seed(0)
    model = Net().to(F64)
    ids = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1))
    want = _steps(copy.deepcopy(model), ids)

    def body():
        mesh = sf.placement("cpu", [[0, 1], [2, 3]])
        m = sf.parallel.apply(model, mesh, RULES)
        out = _steps(m, sf.tensor(ids, mesh, (S(0), B)))
        return out, sf.comm.stats().kinds.get("fallback")
    got, fallback = sf.launch(body, world_size=4)[0]
    assert fallback is None            # every op had a rule for the styles' layouts
    assert got[0] == pytest.approx(want[0], rel=1e-12)
    for k, v in want[1].items():
        torch.testing.assert_close(got[1][k], v, rtol=1e-10, atol=1e-12)
