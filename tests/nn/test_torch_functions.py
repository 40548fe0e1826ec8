"""torch functions on global tensors (``torch.*``, ``torch.nn.functional.*``, Tensor methods,
``torch.nn.init``) against the same calls on one device (float64), in several layouts; plain
torch tensors mixed in; in-place ops; and the functions refused with an `sf.SbpError`."""

import torch
import torch.nn.functional as F

import sbpflow as sf

F64 = torch.float64


def _rand(*shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed))


X, W = _rand(4, 6, 8, seed=0), _rand(12, 8, seed=1)
MASK = torch.tril(torch.ones(6, 8)) == 0       # a plain bool tensor: taken as replicated
POS = torch.arange(6)                          # plain positions


def _inplace(x):
    y = x.clone()
    y += x
    y.mul_(2).add_(1)
    y -= 0.5
    return torch.nn.functional.relu(y, inplace=True)


# name -> fn(x, w); x is (4, 6, 8), w (12, 8): global tensors, or their torch values
CASES = {
    "linear": lambda x, w: F.linear(x, w),
    "flatten": lambda x, w: torch.flatten(x, 1),
    "cat": lambda x, w: torch.cat([x, x * 2], 2),
    "stack": lambda x, w: torch.stack([x, x], dim=1),
    "list_index": lambda x, w: x[:, [-1], :],
    "list_index_2": lambda x, w: x[..., [0, 5, 2]],
    "split": lambda x, w: torch.split(x, 4, dim=1)[1],
    "chunk": lambda x, w: x.chunk(2, dim=2)[1],
    "sdpa_causal": lambda x, w: F.scaled_dot_product_attention(x, x, x, is_causal=True),
    "masked_fill": lambda x, w: x.masked_fill(MASK, 0.0),
    "where": lambda x, w: torch.where(MASK, x, -1.0),
    "plain_plus": lambda x, w: POS.to(F64)[:, None] + x,
    "plus_plain": lambda x, w: x - POS.to(F64)[:, None],
    "softmax": lambda x, w: F.softmax(x, dim=-1) + torch.softmax(x, 1),
    "gelu_tanh": lambda x, w: F.gelu(x, approximate="tanh"),
    "layer_norm": lambda x, w: F.layer_norm(x, (8,)),
    "view": lambda x, w: x.transpose(1, 2).contiguous().view(4, -1),
    "view_heads": lambda x, w: x.view(4, 6, 2, 4).transpose(1, 2),
    "zeros_like": lambda x, w: torch.zeros_like(x) + torch.ones_like(x) * 3 + x,
    "unbind": lambda x, w: x.unbind(0)[1],
    "mse_loss": lambda x, w: F.mse_loss(x, x * 0.5),
    "mT": lambda x, w: x.mT,
    "in_place": lambda x, w: _inplace(x),
    "sum_dim": lambda x, w: torch.sum(x, dim=1),
    "type_as": lambda x, w: x.type_as(POS),
}
LAYOUTS = [sf.S(0), sf.S(1), sf.S(2), sf.B]


def test_torch_functions_equal_torch_in_every_layout():
    def body():
        pl = sf.placement("cpu", [0, 1])
        w = sf.tensor(W, pl, sf.B)
        bad = []
        for sbp in LAYOUTS:
            x = sf.tensor(X, pl, sbp)
            for name, fn in CASES.items():
                got = fn(x, w)
                assert isinstance(got, sf.GlobalTensor), name
                want = fn(X, W)
                got = got.full_tensor()
                if got.dtype != want.dtype or got.shape != want.shape or \
                        not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
                    bad.append((name, sbp))
        return bad
    assert sf.launch(body, world_size=2)[0] == []


def test_metadata_as_torch():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(X, pl, sf.S(1))
        b, t, c = x.size()
        return ((b, t, c), x.size(-1), x.device, x.dim(), x.numel(), x.is_floating_point(),
                torch.is_floating_point(x), x.ndimension(), x.is_cuda, len(x))
    got = sf.launch(body, world_size=2)[0]
    assert got == ((4, 6, 8), 8, torch.device("cpu"), 3, 192, True, True, 3, False, 4)


def test_in_place_on_a_parameter_keeps_the_object_and_its_shard():
    def body():
        pl = sf.placement("cpu", [0, 1])
        p = sf.nn.Parameter(sf.tensor(X, pl, sf.S(1)))
        local = p.local
        with torch.no_grad():
            p.mul_(0.5)
            p -= 1.0
            p.copy_(p * 2)
        try:
            p.add_(1.0)  # grad mode, a leaf that requires grad: torch refuses it
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        return p.local is local, p.requires_grad, p.sbp, p.full_tensor(), refused
    same, grad, sbp, value, refused = sf.launch(body, world_size=2)[0]
    assert same and grad and sbp == (sf.S(1),)
    torch.testing.assert_close(value, (X * 0.5 - 1.0) * 2)
    assert refused is not None and "leaf" in refused


def test_in_place_inside_autograd_gives_torch_gradients():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(X, pl, sf.S(0)).requires_grad_()
        y = x * 3
        y += x
        y = F.relu(y - 1.0, inplace=True)
        y.sum().backward()
        return x.grad.full_tensor()
    ref = X.clone().requires_grad_()
    y = ref * 3
    y += ref
    torch.nn.functional.relu(y - 1.0, inplace=True).sum().backward()
    torch.testing.assert_close(sf.launch(body, world_size=2)[0], ref.grad)


def test_torch_init_on_global_parameters_is_layout_independent():
    inits = {
        "normal": lambda p: torch.nn.init.normal_(p, 0.0, 0.02),
        "uniform": lambda p: torch.nn.init.uniform_(p, -0.1, 0.1),
        "kaiming": lambda p: torch.nn.init.kaiming_uniform_(p, a=5 ** 0.5),
        "xavier": lambda p: torch.nn.init.xavier_normal_(p),
        "trunc": lambda p: torch.nn.init.trunc_normal_(p, std=0.02, a=-0.04, b=0.04),
        "zeros": torch.nn.init.zeros_, "ones": torch.nn.init.ones_,
        "constant": lambda p: torch.nn.init.constant_(p, 0.25),
    }

    def body(sbp):
        pl = sf.placement("cpu", [0, 1])
        out = {}
        for name, fill in inits.items():
            sf.manual_seed(7)
            p = sf.nn.Parameter(sf.zeros(12, 8, placement=pl, sbp=sbp, dtype=F64))
            with torch.no_grad():
                fill(p)
            out[name] = p.full_tensor()
        return out
    split = sf.launch(body, world_size=2, args=(sf.S(0),))[0]
    whole = sf.launch(body, world_size=2, args=(sf.B,))[0]
    for name in inits:
        torch.testing.assert_close(split[name], whole[name], msg=name)
    assert split["zeros"].abs().max() == 0 and (split["ones"] == 1).all()
    assert (split["constant"] == 0.25).all() and split["uniform"].abs().max() <= 0.1
    assert split["trunc"].abs().max() <= 0.04 and 0.005 < split["normal"].std() < 0.04
    bound = (6 / ((1 + 5) * 8)) ** 0.5  # torch's kaiming_uniform_ bound, a = sqrt(5)
    assert split["kaiming"].abs().max() <= bound


REFUSED = {
    "setitem_list": lambda x: x.__setitem__(([0, 1], [1, 2]), 1.0),
    "setitem_rows": lambda x: x.__setitem__(x[:, :, 0] > 0, x[:2, 0]),
    "numpy": lambda x: x.numpy(),
    "to_cuda": lambda x: x.to("cuda"),
    "cuda": lambda x: x.cuda(),
    "data_ptr": lambda x: x.data_ptr(),
    "embedding_max_norm": lambda x: F.embedding(sf.tensor(torch.tensor([0, 1]), x.placement,
                                                          sf.B), x[0], max_norm=1.0),
}


def test_unsupported_functions_raise_an_sbp_error_naming_them():
    def body():
        pl = sf.placement("cpu", [0, 1])
        x = sf.tensor(X, pl, sf.S(0))
        out = {}
        for name, fn in REFUSED.items():
            try:
                fn(x)
                out[name] = None
            except Exception as exc:  # noqa: BLE001 - the test reads the class
                out[name] = (type(exc), str(exc))
        return out
    out = sf.launch(body, world_size=2)[0]
    for name, got in out.items():
        assert got is not None, f"{name} ran"
        kind, text = got
        assert issubclass(kind, sf.SbpError), (name, kind, text)
    assert issubclass(sf.errors.UnsupportedTorchFunction, sf.SbpError)
    assert "Tensor.data_ptr" in out["data_ptr"][1] and "shape (4, 6, 8)" in out["data_ptr"][1]
    assert "x.local" in out["data_ptr"][1]
    assert "to_global" in out["cuda"][1]
    assert "to_global" in out["to_cuda"][1] and "max_norm" in out["embedding_max_norm"][1]
    assert "torch.where" in out["setitem_list"][1] and "full_tensor" in out["numpy"][1]
    assert "one row per selected entry" in out["setitem_rows"][1]


def test_unknown_attributes_stay_attribute_errors():
    def body():
        x = sf.tensor(X, sf.placement("cpu", [0]), sf.B)
        return hasattr(x, "no_such_thing"), hasattr(x, "_private"), hasattr(x, "masked_fill")
    assert sf.launch(body, world_size=1)[0] == (False, False, True)


def test_attention_dropout_is_layout_independent_and_drops_its_share():
    """``F.scaled_dot_product_attention(is_causal=True, dropout_p=p)``: with q = k = 0 every
    attended entry weighs 1 / (i + 1), and v = I makes the output the dropped weights
    themselves, so each entry is 0 or 1 / ((i + 1)(1 - p))."""
    b, h, t, p = 4, 2, 16, 0.3
    zeros, eye = torch.zeros(b, h, t, t, dtype=F64), torch.eye(t, dtype=F64).expand(b, h, t, t)

    def body():
        pl = sf.placement("cpu", [0, 1])
        out = {}
        for sbp in (sf.S(0), sf.S(1), sf.B):
            q, v = sf.tensor(zeros, pl, sbp), sf.tensor(eye, pl, sbp)
            sf.manual_seed(7)
            out[sbp] = F.scaled_dot_product_attention(q, q, v, is_causal=True,
                                                      dropout_p=p).full_tensor()
            out[sbp, 0.0] = F.scaled_dot_product_attention(q, q, v, is_causal=True,
                                                           dropout_p=0.0).full_tensor()
        return out
    out = sf.launch(body, world_size=2)[0]
    got = out[sf.S(0)]
    assert torch.equal(got, out[sf.S(1)]) and torch.equal(got, out[sf.B])
    want = F.scaled_dot_product_attention(zeros, zeros, eye, is_causal=True)
    for sbp in (sf.S(0), sf.S(1), sf.B):
        torch.testing.assert_close(out[sbp, 0.0], want, rtol=1e-12, atol=1e-12)
    causal = torch.ones(t, t, dtype=torch.bool).tril().expand(b, h, t, t)
    assert not got[~causal].any()                       # the mask: nothing above the diagonal
    kept = got[causal] != 0
    torch.testing.assert_close(got[causal][kept], (want / (1 - p))[causal][kept])
    dropped = 1.0 - kept.double().mean().item()         # 1088 entries, a fixed seed
    assert abs(dropped - p) < 0.05, dropped


def test_sbpflow_functional_takes_plain_torch_tensors_and_torch_names():
    """``sf.nn.functional`` as torch.nn.functional: a target, class weights, ids or a mask given
    as plain torch tensors are taken as replicated; torch's other names (mse_loss) run too."""
    SF = sf.nn.functional
    logits, target = _rand(6, 5, seed=4), torch.tensor([0, 4, 2, 2, 1, 3])
    cw, ids, table = _rand(5, seed=5).abs(), torch.tensor([[1, 0, 3]]), _rand(4, 8, seed=6)
    cases = {
        "cross_entropy": (lambda lg, t: SF.cross_entropy(lg, target, weight=cw),
                          lambda: F.cross_entropy(logits, target, weight=cw)),
        "nll_loss": (lambda lg, t: SF.nll_loss(SF.log_softmax(lg, -1), target),
                     lambda: F.nll_loss(F.log_softmax(logits, -1), target)),
        "embedding": (lambda lg, t: SF.embedding(ids, t), lambda: F.embedding(ids, table)),
        "sdpa_mask": (lambda lg, t: SF.scaled_dot_product_attention(
            t[None], t[None], t[None], attn_mask=MASK[:4, :4] == 0),
            lambda: F.scaled_dot_product_attention(table[None], table[None], table[None],
                                                   attn_mask=MASK[:4, :4] == 0)),
        "mse_loss": (lambda lg, t: SF.mse_loss(lg, logits * 0.5),
                     lambda: F.mse_loss(logits, logits * 0.5)),
    }

    def body(sbp):
        pl = sf.placement("cpu", [0, 1])
        lg, t = sf.tensor(logits, pl, sbp), sf.tensor(table, pl, sf.B)
        return {name: fn(lg, t).full_tensor() for name, (fn, _) in cases.items()}
    for sbp in (sf.S(0), sf.S(1), sf.B):
        got = sf.launch(body, world_size=2, args=(sbp,))[0]
        for name, (_, want) in cases.items():
            torch.testing.assert_close(got[name], want(), rtol=1e-12, atol=1e-12,
                                       msg=f"{name} {sbp}")
    try:
        SF.no_such_function
        raise AssertionError("an unknown name resolved")
    except AttributeError as exc:
        assert "no_such_function" in str(exc)
