"""Bad inputs (issue 12): how sbpflow answers mistakes a user can make with the public API.

Each case is one mistake (a bad sbp, a bad placement, mismatched shapes or placements, an index
out of range, a bad optimizer argument, ...). It runs on 4 in-process ranks (``sf.launch``,
threads backend, collective timeout ``--limit`` s) in a watcher thread, so a hang is caught:
the case then counts as not raised promptly. Per case the table shows the exception raised,
the seconds to raise it, whether it is an ``sf.SbpError``, whether it is also the built-in
exception torch raises for the same mistake (found by running the plain-torch equivalent where
there is one: ValueError / TypeError / IndexError / RuntimeError ...), and whether its message
names what is involved: every "needle" of the case (the shape tuples, sbps, placement, or the
bad value itself) appears in it. Then the summary line

    bad inputs: N; raised promptly: N; as sf.SbpError: N; naming shapes/layouts: N

and the cases that raised nothing, hung, or raised an unclear error (neither an SbpError nor
torch's exception for it, or a message missing what is involved).

    .venv/bin/python benchmarks/bad_inputs.py [--only WORD] [--limit 5] [-v]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

import sbpflow as sf
import sbpflow.nn.functional as SF

WORLD = 4
PL4 = ("cpu[0,1,2,3]", "ranks=[0, 1, 2, 3]")  # a needle: either spelling of the placement
M22 = ("cpu[[0,1],[2,3]]", "ranks=[[0, 1], [2, 3]]")


@dataclass
class Case:
    """``fn`` makes the mistake (on every rank unless ``ranks`` is False: then once, on the
    caller); ``torch`` is the exception class torch raises for it, or a plain-torch callable
    making the same mistake (its exception's class is then the reference); ``needles`` are the
    strings (or tuples of alternatives) the message should contain."""

    name: str
    fn: Callable[[], Any]
    torch: Any
    needles: tuple
    ranks: bool = True


CASES: list[Case] = []


def case(name: str, fn: Callable[[], Any], torch_ref: Any, *needles, ranks: bool = True) -> None:
    CASES.append(Case(name, fn, torch_ref, needles, ranks))


# -- fixtures (built inside the rank functions: each rank makes its own) --------------------------
def p4() -> sf.Placement:
    return sf.placement("cpu", ranks=[0, 1, 2, 3])


def m22() -> sf.Placement:
    return sf.placement("cpu", ranks=[[0, 1], [2, 3]])


def pl(*ranks: int) -> sf.Placement:
    return sf.placement("cpu", ranks=list(ranks))


def x46(sbp=sf.S(0), placement=None, **kw) -> sf.GlobalTensor:
    return sf.randn(4, 6, placement=placement or p4(), sbp=sbp, seed=0, **kw)


def rnd(*shape, sbp=sf.B, placement=None, **kw) -> sf.GlobalTensor:
    return sf.randn(*shape, placement=placement or p4(), sbp=sbp, seed=1, **kw)


def ids(values, sbp=sf.B, placement=None) -> sf.GlobalTensor:
    return sf.tensor(torch.tensor(values), placement or p4(), sbp)


def T(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype)


def _sbp_cases() -> None:
    case("randn S(5) on a 2-D tensor", lambda: x46(sf.S(5)), None, "(4, 6)", "S(5)")
    case("tensor with sbp 'X'", lambda: sf.tensor(T(4, 6), p4(), "X"), None, "'X'")
    case("nd-sbp with an 'X' entry", lambda: x46(("S(0)", "X"), m22()), None, "'X'")
    case("nd-sbp of 2 on a 1-D mesh", lambda: x46((sf.S(0), sf.B)), None,
         "(S(0), B)", PL4, "(4, 6)")
    case("nd-sbp of 1 on a 2-D mesh", lambda: x46(sf.S(0), m22()), None, "(S(0),)",
         M22, "(4, 6)")
    case("S(-1)", lambda: x46(sf.S(-1)), None, "-1")
    case("S('a')", lambda: x46(sf.S("a")), None, "'a'")
    case("P('avg')", lambda: x46(sf.P("avg")), None, "'avg'")
    case("sbp given as an int", lambda: x46(5), None, "5")
    case("sbp string 'S(x)'", lambda: x46("S(x)"), None, "'S(x)'")
    case("to_global S(3) on a 2-D tensor", lambda: x46().to_global(sbp=sf.S(3)), None,
         "(4, 6)", "S(3)")
    case("to_global: other-size placement, nd-sbp of 2",
         lambda: x46().to_global(placement=pl(0, 1), sbp=(sf.S(0), sf.B)), None,
         "(S(0), B)", ("cpu[0,1]", "ranks=[0, 1]"), "(4, 6)")
    case("to_global: 2-D mesh, sbp omitted", lambda: x46().to_global(placement=m22()),
         None, "(S(0),)", M22, "(4, 6)")
    case("to_global: sbp string 'S(0),S(1)' on a 1-D mesh",
         lambda: x46().to_global(sbp="S(0),S(1)"), None, "(S(0), S(1))", PL4, "(4, 6)")
    case("to_global: placement as a string", lambda: x46().to_global(placement="cpu"),
         None, "'cpu'")
    case("from_local S(2) on a 2-D shard", lambda: sf.from_local(T(1, 6), p4(), sf.S(2)),
         None, "(1, 6)", "S(2)")
    case("Linear with weight sbp S(2)", lambda: sf.nn.Linear(6, 3, placement=p4(), sbp=sf.S(2)),
         None, "(3, 6)", "S(2)")


def _placement_cases() -> None:
    case("duplicate ranks", lambda: sf.placement("cpu", ranks=[0, 0, 1, 2]), None,
         "[0, 0, 1, 2]")
    case("ranks outside the world (randn)",
         lambda: sf.randn(4, 6, placement=sf.placement("cpu", ranks=list(range(8)))),
         None, "[4, 5, 6, 7]", "4")
    case("ranks outside the world (to_global)",
         lambda: x46().to_global(placement=pl(2, 3, 4, 5), sbp=sf.S(0)), None, "[4, 5]")
    case("ragged mesh", lambda: sf.placement("cpu", ranks=[[0, 1], [2]]), None,
         "[[0, 1], [2]]")
    case("unknown device 'tpu'", lambda: sf.placement("tpu", ranks=[0, 1]),
         lambda: torch.device("tpu"), "'tpu'")
    case("negative rank", lambda: sf.placement("cpu", ranks=[-1, 0, 1]), None, "-1")
    case("empty ranks", lambda: sf.placement("cpu", ranks=[]), None, "[]")
    case("mesh shape that does not hold the ranks",
         lambda: sf.placement("cpu", ranks=[0, 1, 2, 3], shape=(3, 2)), None, "(3, 2)")
    case("ranks given as a string", lambda: sf.placement("cpu", ranks="0123"), None, "'0123'")
    case("parallel.apply with a placement string",
         lambda: sf.parallel.apply(sf.nn.Linear(6, 3), "cpu", {"*": sf.B}), None, "'cpu'")
    if not torch.cuda.is_available():
        case("cuda placement without CUDA",
             lambda: sf.randn(4, 6, placement=sf.placement("cuda", ranks=[0, 1, 2, 3])),
             lambda: torch.zeros(1, device="cuda"), "cuda")


def _mismatch_cases() -> None:
    a01, b23 = ("cpu[0,1]", "ranks=[0, 1]"), ("cpu[2,3]", "ranks=[2, 3]")
    case("add: tensors on [0,1] and [2,3]",
         lambda: rnd(4, 6, placement=pl(0, 1)) + rnd(4, 6, placement=pl(2, 3)), None,
         a01, b23, "(4, 6)")
    case("matmul: 1-D and 2-D mesh",
         lambda: x46() @ rnd(6, 3, sbp=(sf.B, sf.B), placement=m22()), None, PL4, M22,
         "(4, 6)", "(6, 3)")
    case("cat: different placements",
         lambda: sf.cat([rnd(4, 6, placement=pl(0, 1)), rnd(4, 6, placement=pl(2, 3))]),
         None, a01, b23)
    case("linear: weight on another placement",
         lambda: SF.linear(rnd(4, 6, placement=pl(0, 1)), rnd(3, 6, placement=pl(2, 3))),
         None, a01, b23, "(3, 6)")
    case("mul: same ranks, 1-D and 2-D mesh",
         lambda: x46(sf.B) * rnd(4, 6, sbp=(sf.B, sf.B), placement=m22()), None, PL4, M22)


def _shape_cases() -> None:
    case("matmul (4,6) @ (5,3)", lambda: x46() @ rnd(5, 3),
         lambda: T(4, 6) @ T(5, 3), "(4, 6)", "(5, 3)", "S(0)")
    case("matmul (4,6) S(1) @ (5,3) S(0)", lambda: x46(sf.S(1)) @ rnd(5, 3, sbp=sf.S(0)),
         lambda: T(4, 6) @ T(5, 3), "(4, 6)", "(5, 3)", "S(1)")
    case("matmul on a 2-D mesh (8,6) @ (5,3)",
         lambda: rnd(8, 6, sbp=(sf.S(0), sf.S(1)), placement=m22())
         @ rnd(5, 3, sbp=(sf.B, sf.S(0)), placement=m22()),
         lambda: T(8, 6) @ T(5, 3), "(8, 6)", "(5, 3)", "(S(0), S(1))")
    case("matmul (6,) @ (5,)", lambda: rnd(6) @ rnd(5), lambda: T(6) @ T(5), "(6,)", "(5,)",
         "(B,)")
    case("add (4,6) + (4,5)", lambda: x46() + rnd(4, 5), lambda: T(4, 6) + T(4, 5),
         "(4, 6)", "(4, 5)", "S(0)")
    case("add (4,6) S(1) + (3,6) B", lambda: x46(sf.S(1)) + rnd(3, 6),
         lambda: T(4, 6) + T(3, 6), "(4, 6)", "(3, 6)", "S(1)")
    case("mul on a 2-D mesh (8,6) * (7,6)",
         lambda: rnd(8, 6, sbp=(sf.S(0), sf.S(1)), placement=m22())
         * rnd(7, 6, sbp=(sf.B, sf.B), placement=m22()),
         lambda: T(8, 6) * T(7, 6), "(8, 6)", "(7, 6)", "(S(0), S(1))")
    case("cat (4,6) and (4,5) on dim 0", lambda: sf.cat([x46(), rnd(4, 5)]),
         lambda: torch.cat([T(4, 6), T(4, 5)]), "(4, 6)", "(4, 5)", "S(0)")
    case("cat on dim 2 of 2-D tensors", lambda: sf.cat([x46(), x46()], dim=2),
         lambda: torch.cat([T(4, 6), T(4, 6)], dim=2), "(4, 6)", "S(0)")
    case("cat of a 2-D and a 1-D tensor", lambda: sf.cat([x46(), rnd(6)]),
         lambda: torch.cat([T(4, 6), T(6)]), "(4, 6)", "(6,)", "S(0)")
    case("cat of an empty list", lambda: sf.cat([]), lambda: torch.cat([]), "[]")


def _view_cases() -> None:
    case("reshape (4,6) -> (5,5)", lambda: x46().reshape(5, 5),
         lambda: T(4, 6).reshape(5, 5), "(4, 6)", "(5, 5)", "S(0)")
    case("view(-1, -1)", lambda: x46().view(-1, -1), lambda: T(4, 6).view(-1, -1),
         "(4, 6)", "-1", "S(0)")
    case("reshape(-1, 5) of 24 elements", lambda: x46().reshape(-1, 5),
         lambda: T(4, 6).reshape(-1, 5), "(4, 6)", "5", "S(0)")
    case("reshape(4, 6, -2)", lambda: x46().reshape(4, 6, -2),
         lambda: T(4, 6).reshape(4, 6, -2), "(4, 6)", "-2", "S(0)")
    case("transpose(0, 2) of a 2-D tensor", lambda: x46().transpose(0, 2),
         lambda: T(4, 6).transpose(0, 2), "(4, 6)", "S(0)")
    case("sum(dim=3) of a 2-D tensor", lambda: x46(sf.S(1)).sum(dim=3),
         lambda: T(4, 6).sum(dim=3), "(4, 6)", "S(1)")
    case("sum(dim=(0, 0))", lambda: x46().sum(dim=(0, 0)), lambda: T(4, 6).sum(dim=(0, 0)),
         "(4, 6)", "S(0)")
    case("softmax(dim=2) of a 2-D tensor", lambda: SF.softmax(x46(), dim=2),
         lambda: torch.softmax(T(4, 6), dim=2), "(4, 6)", "S(0)")
    case("log_softmax(dim=-3), split axis", lambda: SF.log_softmax(x46(sf.S(1)), dim=-3),
         lambda: torch.log_softmax(T(4, 6), dim=-3), "(4, 6)", "S(1)")
    case("permute with too few dims", lambda: x46().permute(0),
         lambda: T(4, 6).permute(0), "(4, 6)", "S(0)")
    case("expand (4,6) -> (4,7)", lambda: x46().expand(4, 7), lambda: T(4, 6).expand(4, 7),
         "(4, 6)", "(4, 7)", "S(0)")
    case("unsqueeze(5) of a 2-D tensor", lambda: x46().unsqueeze(5),
         lambda: T(4, 6).unsqueeze(5), "(4, 6)", "S(0)")
    case("squeeze(5) of a 2-D tensor", lambda: x46().squeeze(5),
         lambda: T(4, 6).squeeze(5), "(4, 6)", "S(0)")
    case("chunk(0)", lambda: x46().chunk(0), lambda: T(4, 6).chunk(0), "(4, 6)", "S(0)")
    case("split(0)", lambda: x46().split(0), lambda: T(4, 6).split(0), "(4, 6)", "S(0)")
    case("flatten(start_dim=3)", lambda: x46().flatten(3), lambda: T(4, 6).flatten(3),
         "(4, 6)", "S(0)")
    case("item() of a (4, 6) tensor", lambda: x46().item(), lambda: T(4, 6).item(),
         "(4, 6)", "S(0)")
    case("len() of a 0-d tensor", lambda: len(x46().sum()), lambda: len(T(4, 6).sum()), "0-d")
    case("scaled_dot_product_attention, key (2, 4, 7) for query (2, 4, 8)",
         lambda: SF.scaled_dot_product_attention(rnd(2, 4, 8, sbp=sf.S(0)),
                                                 rnd(2, 4, 7, sbp=sf.S(0)),
                                                 rnd(2, 4, 8, sbp=sf.S(0))),
         lambda: torch.nn.functional.scaled_dot_product_attention(T(2, 4, 8), T(2, 4, 7),
                                                                  T(2, 4, 8)),
         "(2, 4, 8)", "(2, 4, 7)", "S(0)")
    case("gelu(approximate='fast')", lambda: SF.gelu(x46(), approximate="fast"),
         lambda: torch.nn.functional.gelu(T(4, 6), approximate="fast"), "fast")


def _rank_shard() -> torch.Tensor:
    return T(sf.rank() + 1, 6)  # rows 1, 2, 3, 4: not a balanced split of any size


def _from_local_cases() -> None:
    case("from_local: unbalanced S(0) shards", lambda: sf.from_local(_rank_shard(), p4(),
                                                                      sf.S(0)),
         None, "S(0)", "(1, 6)", PL4)
    case("from_local: shard does not fit the given shape",
         lambda: sf.from_local(T(2, 6), p4(), sf.S(0), shape=(4, 6)), None,
         "(2, 6)", "(4, 6)", "S(0)", PL4)
    case("from_local: B shards of different shapes",
         lambda: sf.from_local(T(4, 7 if sf.rank() == 3 else 6), p4(), sf.B), None,
         "(4, 7)", "(4, 6)", "B", PL4)
    case("from_local: shards with different ndim",
         lambda: sf.from_local(T(4) if sf.rank() == 3 else T(1, 4), p4(), sf.S(0)), None,
         "(4,)", "(1, 4)", "S(0)")
    case("from_local: given shape of another ndim",
         lambda: sf.from_local(T(1, 6), p4(), sf.S(0), shape=(4, 6, 1)), None,
         "(1, 6)", "(4, 6, 1)", "S(0)")
    case("from_local outside the placement without shape",
         lambda: sf.from_local(T(2, 6), pl(0, 1), sf.S(0)), None, ("cpu[0,1]", "ranks=[0, 1]"),
         "shape")
    case("from_local of a list", lambda: sf.from_local([1.0, 2.0], p4(), sf.B), None, "list")


def _backward_cases() -> None:
    def non_scalar():
        x46(requires_grad=True).sum(dim=0).backward()

    def no_grad():
        x46().sum().backward()

    def bad_gradient():
        y = x46(requires_grad=True) * 2.0
        y.backward(rnd(4, 5, sbp=sf.P))

    def twice():
        y = (x46(requires_grad=True) * x46()).sum()
        y.backward()
        y.backward()

    tx = lambda: torch.ones(4, 6, requires_grad=True)  # noqa: E731
    case("backward on a non-scalar without gradient", non_scalar,
         lambda: tx().sum(dim=0).backward(), "(6,)", "sbp", PL4)
    case("backward on a tensor not requiring grad", no_grad,
         lambda: T(4, 6).sum().backward(), "()", "sbp", PL4)
    case("backward with a gradient of another shape", bad_gradient,
         lambda: (tx() * 2.0).backward(T(4, 5)), "(4, 5)", "(4, 6)", "S(0)", PL4)
    case("backward twice without retain_graph", twice,
         lambda: [y.backward() for y in [(tx() * tx()).sum()] for _ in range(2)], "retain_graph")


def _index_cases() -> None:
    t10 = torch.zeros(10, 4)
    tab = lambda sbp, placement=None: rnd(10, 4, sbp=sbp, placement=placement)  # noqa: E731
    emb = lambda: torch.nn.functional.embedding(torch.tensor([[1, 12]]), t10)  # noqa: E731
    case("embedding id 12 of 10, B table", lambda: SF.embedding(ids([[1, 12]]), tab(sf.B)),
         emb, "12", "(10, 4)", "(B,)")
    case("embedding id 12 of 10, vocab-split table",
         lambda: SF.embedding(ids([[1, 12]]), tab(sf.S(0))), emb, "12", "(10, 4)", "S(0)")
    case("embedding id 12 of 10, dim-split table",
         lambda: SF.embedding(ids([[1, 12]]), tab(sf.S(1))), emb, "12", "(10, 4)", "S(1)")
    case("embedding id -1, ids split",
         lambda: SF.embedding(ids([[1], [2], [-1], [3]], sf.S(0)), tab(sf.B)),
         lambda: torch.nn.functional.embedding(torch.tensor([-1]), t10), "-1", "(10, 4)",
         "S(0)")
    case("embedding id 12 of 10, 2-D mesh",
         lambda: SF.embedding(ids([[1, 12], [0, 3]], (sf.S(0), sf.B), m22()),
                              tab((sf.B, sf.S(0)), m22())), emb, "12", "(10, 4)", "(S(0), B)")
    case("Embedding module, id 10 of 10",
         lambda: sf.nn.Embedding(10, 4, placement=p4(), sbp=sf.S(0))(ids([[10]])),
         lambda: torch.nn.Embedding(10, 4)(torch.tensor([[10]])), "10", "(10, 4)", "S(0)")
    case("embedding with float ids",
         lambda: SF.embedding(sf.tensor(T(2, 3), p4(), sf.B), tab(sf.B)),
         lambda: torch.nn.functional.embedding(T(2, 3), t10), "float32", "(2, 3)", "(B,)")
    lg = lambda sbp: rnd(4, 5, sbp=sbp)  # noqa: E731
    ce = lambda t: torch.nn.functional.cross_entropy(T(4, 5), torch.tensor(t))  # noqa: E731
    case("cross_entropy target 7 of 5 classes, B logits",
         lambda: SF.cross_entropy(lg(sf.B), ids([0, 7, 1, 2])).item(),
         lambda: ce([0, 7, 1, 2]), "7", "(4, 5)", "(B,)")
    case("cross_entropy target 7, class-split logits",
         lambda: SF.cross_entropy(lg(sf.S(1)), ids([0, 7, 1, 2])).item(),
         lambda: ce([0, 7, 1, 2]), "7", "(4, 5)", "S(1)")
    case("cross_entropy target 7, batch-split",
         lambda: SF.cross_entropy(lg(sf.S(0)), ids([0, 7, 1, 2], sf.S(0))).item(),
         lambda: ce([0, 7, 1, 2]), "7", "(4, 5)", "S(0)")
    case("cross_entropy target -3 (not ignore_index)",
         lambda: SF.cross_entropy(lg(sf.B), ids([0, -3, 1, 2])).item(),
         lambda: ce([0, -3, 1, 2]), "-3", "(4, 5)", "(B,)")
    case("x[10] of 4 rows, B", lambda: x46(sf.B)[10], lambda: T(4, 6)[10], "10", "(4, 6)",
         "(B,)")
    case("x[10] of 4 rows, S(0)", lambda: x46()[10], lambda: T(4, 6)[10], "10", "(4, 6)",
         "S(0)")
    case("x[:, 7] of 6 columns, S(1)", lambda: x46(sf.S(1))[:, 7], lambda: T(4, 6)[:, 7],
         "7", "(4, 6)", "S(1)")
    case("x[-5] of 4 rows, S(0)", lambda: x46()[-5], lambda: T(4, 6)[-5], "-5", "(4, 6)",
         "S(0)")
    case("x[0, 0, 0] of a 2-D tensor", lambda: x46()[0, 0, 0], lambda: T(4, 6)[0, 0, 0],
         "(4, 6)", "S(0)")
    case("narrow(0, 3, 5) of 4 rows, S(0)", lambda: x46().narrow(0, 3, 5),
         lambda: T(4, 6).narrow(0, 3, 5), "(4, 6)", "S(0)")
    case("narrow(1, 4, 5) of 6 columns, B", lambda: x46(sf.B).narrow(1, 4, 5),
         lambda: T(4, 6).narrow(1, 4, 5), "(4, 6)", "(B,)")
    case("narrow(0, -9, 1) of 4 rows", lambda: x46().narrow(0, -9, 1),
         lambda: T(4, 6).narrow(0, -9, 1), "(4, 6)", "-9", "S(0)")
    case("narrow on dim 2 of a 2-D tensor", lambda: x46().narrow(2, 0, 1),
         lambda: T(4, 6).narrow(2, 0, 1), "(4, 6)", "S(0)")


def _dtype_cases() -> None:
    case("matmul float32 @ float64", lambda: x46() @ rnd(6, 3, dtype=torch.float64),
         lambda: T(4, 6) @ T(6, 3, dtype=torch.float64), "float32", "float64", "(4, 6)", "S(0)")
    case("linear: float32 input, float64 weight",
         lambda: SF.linear(x46(), rnd(3, 6, dtype=torch.float64)),
         lambda: torch.nn.functional.linear(T(4, 6), T(3, 6, dtype=torch.float64)),
         "float32", "float64", "(3, 6)", "S(0)")
    case("matmul int64 @ float32",
         lambda: sf.ones(4, 6, placement=p4(), dtype=torch.int64) @ rnd(6, 3),
         lambda: T(4, 6, dtype=torch.int64) @ T(6, 3), "int64", "float32", "(4, 6)", "(B,)")
    case("linear: float64 bias", lambda: SF.linear(x46(), rnd(3, 6), rnd(3, dtype=torch.float64)),
         lambda: torch.nn.functional.linear(T(4, 6), T(3, 6), T(3, dtype=torch.float64)),
         "float64", "(3,)", "(B,)")
    case("randn with dtype int64", lambda: sf.randn(4, 6, placement=p4(), dtype=torch.int64),
         lambda: torch.randn(4, 6, dtype=torch.int64), ("Long", "int64"), "(4, 6)")


def _params() -> list:
    return list(sf.nn.Linear(6, 3, placement=p4()).parameters())


def _optim_cases() -> None:
    tp = lambda: [torch.zeros(3, requires_grad=True)]  # noqa: E731
    case("SGD lr=-1", lambda: sf.optim.SGD(_params(), lr=-1.0),
         lambda: torch.optim.SGD(tp(), lr=-1.0), "-1")
    case("AdamW betas (1.5, 0.9)", lambda: sf.optim.AdamW(_params(), betas=(1.5, 0.9)),
         lambda: torch.optim.AdamW(tp(), betas=(1.5, 0.9)), "1.5")
    case("Adam eps=-1", lambda: sf.optim.Adam(_params(), eps=-1.0),
         lambda: torch.optim.Adam(tp(), eps=-1.0), "-1")
    case("SGD momentum=-0.5", lambda: sf.optim.SGD(_params(), lr=0.1, momentum=-0.5),
         lambda: torch.optim.SGD(tp(), lr=0.1, momentum=-0.5), "-0.5")
    case("SGD of plain torch tensors", lambda: sf.optim.SGD(tp(), lr=0.1),
         lambda: torch.optim.SGD([[0.0]], lr=0.1), "Tensor")
    case("SGD of a non-leaf global tensor",
         lambda: sf.optim.SGD([x46(requires_grad=True) * 2.0], lr=0.1),
         lambda: torch.optim.SGD([tp()[0] * 2.0], lr=0.1), "(4, 6)", "S(0)")
    case("AdamW of an empty parameter list", lambda: sf.optim.AdamW([], lr=0.1),
         lambda: torch.optim.AdamW([], lr=0.1), "empty")


def _state_dict_cases() -> None:
    lin = lambda: sf.nn.Linear(6, 3, placement=p4(), sbp=sf.S(0))  # noqa: E731
    tl = lambda: torch.nn.Linear(6, 3)  # noqa: E731
    good = {"weight": T(3, 6), "bias": T(3)}
    case("load_state_dict missing 'bias'", lambda: lin().load_state_dict({"weight": T(3, 6)}),
         lambda: tl().load_state_dict({"weight": T(3, 6)}), "'bias'")
    case("load_state_dict weight of shape (3, 5)",
         lambda: lin().load_state_dict({**good, "weight": T(3, 5)}),
         lambda: tl().load_state_dict({**good, "weight": T(3, 5)}), "(3, 5)", "(3, 6)", "S(0)")
    case("load_state_dict unexpected key", lambda: lin().load_state_dict({**good, "extra": T(1)}),
         lambda: tl().load_state_dict({**good, "extra": T(1)}), "'extra'")
    case("load_state_dict value not a tensor",
         lambda: lin().load_state_dict({**good, "bias": [0.0, 0.0, 0.0]}),
         lambda: tl().load_state_dict({**good, "bias": [0.0, 0.0, 0.0]}), "bias", "list")


def _apply_cases() -> None:
    lin = lambda: sf.nn.Linear(6, 3)  # noqa: E731
    case("parallel.apply: no rule for 'bias'",
         lambda: sf.parallel.apply(lin(), p4(), {"weight": sf.B}), None, "bias", PL4)
    case("parallel.apply: 1-entry sbp on a 2-D mesh",
         lambda: sf.parallel.apply(lin(), m22(), {"*": sf.S(0)}), None, "(S(0),)", M22)
    case("parallel.apply: S(1) for the 1-D bias",
         lambda: sf.parallel.apply(lin(), p4(), {"*": sf.S(1)}), None, "(3,)", "S(1)",
         "bias")
    case("parallel.apply: placement outside the world",
         lambda: sf.parallel.apply(lin(), pl(0, 1, 2, 3, 4, 5), {"*": sf.B}), None, "[4, 5]")


def _launch_cases() -> None:
    def noop():
        return None

    case("launch world_size=0", lambda: sf.launch(noop, world_size=0), None, "0", ranks=False)
    case("launch world_size=-2", lambda: sf.launch(noop, world_size=-2), None, "-2",
         ranks=False)
    case("launch world_size='4'", lambda: sf.launch(noop, world_size="4"), None, "'4'",
         ranks=False)
    case("launch backend='mpi'", lambda: sf.launch(noop, world_size=2, backend="mpi"), None,
         "'mpi'", ranks=False)
    case("launch of a non-callable", lambda: sf.launch(5, world_size=2), TypeError, "int",
         ranks=False)


def _loss_cases() -> None:
    lg = lambda: rnd(4, 5, sbp=sf.S(0))  # noqa: E731
    tgt = lambda: ids([0, 1, 2, 3])  # noqa: E731
    F = torch.nn.functional
    long4 = lambda: torch.zeros(4, dtype=torch.long)  # noqa: E731
    case("cross_entropy with float targets (4,)",
         lambda: SF.cross_entropy(lg(), sf.tensor(T(4), p4(), sf.B)),
         lambda: F.cross_entropy(T(4, 5), T(4)), "(4,)", "(4, 5)", "S(0)")
    case("cross_entropy reduction='avg'", lambda: SF.cross_entropy(lg(), tgt(), reduction="avg"),
         lambda: F.cross_entropy(T(4, 5), long4(), reduction="avg"), "avg")
    case("cross_entropy label_smoothing=1.5",
         lambda: SF.cross_entropy(lg(), tgt(), label_smoothing=1.5),
         lambda: F.cross_entropy(T(4, 5), long4(), label_smoothing=1.5), "1.5")
    case("cross_entropy target (3,) for logits (4, 5)",
         lambda: SF.cross_entropy(lg(), ids([0, 1, 2])),
         lambda: F.cross_entropy(T(4, 5), torch.zeros(3, dtype=torch.long)), "(3,)", "(4, 5)",
         "S(0)")
    case("cross_entropy weight (4,) for 5 classes",
         lambda: SF.cross_entropy(lg(), tgt(), weight=rnd(4)),
         lambda: F.cross_entropy(T(4, 5), long4(), weight=T(4)), "(4,)", "(4, 5)", "S(0)")
    case("CrossEntropyLoss(reduction='avg')",
         lambda: sf.nn.CrossEntropyLoss(reduction="avg")(lg(), tgt()),
         lambda: torch.nn.CrossEntropyLoss(reduction="avg")(T(4, 5), long4()), "avg")
    case("dropout p=1.5", lambda: SF.dropout(x46(), p=1.5), lambda: F.dropout(T(4, 6), p=1.5),
         "1.5")
    case("dropout p=-0.1", lambda: SF.dropout(x46(), p=-0.1), lambda: F.dropout(T(4, 6), p=-0.1),
         "-0.1")
    case("Dropout(p=2) module", lambda: sf.nn.Dropout(p=2.0), lambda: torch.nn.Dropout(p=2.0),
         "2")
    case("layer_norm normalized_shape (5,) on (4, 6)", lambda: SF.layer_norm(x46(), (5,)),
         lambda: F.layer_norm(T(4, 6), (5,)), "(5,)", "(4, 6)", "S(0)")
    case("layer_norm weight (5,) for normalized_shape (6,)",
         lambda: SF.layer_norm(x46(), (6,), weight=rnd(5)),
         lambda: F.layer_norm(T(4, 6), (6,), weight=T(5)), "(5,)", "(6,)", "S(0)")
    case("layer_norm weight (5,), split hidden dim",
         lambda: SF.layer_norm(x46(sf.S(1)), (6,), weight=rnd(5)),
         lambda: F.layer_norm(T(4, 6), (6,), weight=T(5)), "(5,)", "(6,)", "S(1)")
    case("layer_norm bias (6, 1), split hidden dim",
         lambda: SF.layer_norm(x46(sf.S(1)), (6,), bias=rnd(6, 1)),
         lambda: F.layer_norm(T(4, 6), (6,), bias=T(6, 1)), "(6, 1)", "(6,)", "S(1)")
    case("LayerNorm(5) module on (4, 6)", lambda: sf.nn.LayerNorm(5, placement=p4())(x46()),
         lambda: torch.nn.LayerNorm(5)(T(4, 6)), "(5,)", "(4, 6)", "S(0)")


def _creation_cases() -> None:
    case("randn(-1, 4)", lambda: sf.randn(-1, 4, placement=p4()), lambda: torch.randn(-1, 4),
         "-1")
    case("randn(4, 6.5)", lambda: sf.randn(4, 6.5, placement=p4()),
         lambda: torch.randn(4, 6.5), "6.5")
    case("zeros('a')", lambda: sf.zeros("a", placement=p4()), lambda: torch.zeros("a"), "'a'")
    case("arange(-5)", lambda: sf.arange(-5, placement=p4()), lambda: torch.arange(-5), "-5")
    case("arange(0, 5, 0)", lambda: sf.arange(0, 5, 0, placement=p4()),
         lambda: torch.arange(0, 5, 0), "step")
    case("full((2, 2), 'x')", lambda: sf.full((2, 2), "x", placement=p4()),
         lambda: torch.full((2, 2), "x"), ("'x'", "str"))
    case("ones(4, -6)", lambda: sf.ones(4, -6, placement=p4()), lambda: torch.ones(4, -6), "-6")
    case("rand((4, 6), 3)", lambda: sf.rand((4, 6), 3, placement=p4()),
         lambda: torch.rand((4, 6), 3), "(4, 6)")


def _module_cases() -> None:
    case("Linear(6, 3) on a (4, 5) input", lambda: sf.nn.Linear(6, 3, placement=p4())(rnd(4, 5)),
         lambda: torch.nn.Linear(6, 3)(T(4, 5)), "(4, 5)", "(3, 6)", "(B,)")
    case("Linear(6, 3, sbp=S(0)) on a (4, 5) S(1) input",
         lambda: sf.nn.Linear(6, 3, placement=p4(), sbp=sf.S(0))(rnd(4, 5, sbp=sf.S(1))),
         lambda: torch.nn.Linear(6, 3)(T(4, 5)), "(4, 5)", "(3, 6)", "S(1)")
    case("Linear(-1, 3)", lambda: sf.nn.Linear(-1, 3, placement=p4()),
         lambda: torch.nn.Linear(-1, 3), "-1")
    case("Conv2d(3, 8, 3) on 4 channels",
         lambda: sf.nn.Conv2d(3, 8, 3, placement=p4())(rnd(2, 4, 8, 8, sbp=sf.S(0))),
         lambda: torch.nn.Conv2d(3, 8, 3)(T(2, 4, 8, 8)), "(2, 4, 8, 8)", "S(0)")
    case("Embedding padding_idx 10 of 10",
         lambda: sf.nn.Embedding(10, 4, padding_idx=10, placement=p4()),
         lambda: torch.nn.Embedding(10, 4, padding_idx=10), "10")


for _add in (_sbp_cases, _placement_cases, _mismatch_cases, _shape_cases, _view_cases,
             _from_local_cases, _backward_cases, _index_cases, _dtype_cases, _optim_cases,
             _state_dict_cases, _apply_cases, _launch_cases, _loss_cases, _creation_cases,
             _module_cases):
    _add()


# -- running ---------------------------------------------------------------------------------------
@dataclass
class Result:
    case: Case
    exc: BaseException | None
    seconds: float
    hung: bool
    torch_type: type | None

    @property
    def message(self) -> str:
        return "" if self.exc is None else str(self.exc)

    @property
    def prompt(self) -> bool:
        return self.exc is not None and not self.hung and self.seconds < LIMIT

    @property
    def sbp_error(self) -> bool:
        return isinstance(self.exc, sf.SbpError)

    @property
    def torch_like(self) -> bool | None:
        """Whether the exception is torch's own class for the mistake (None: torch has no
        equivalent of it, e.g. a placement or an sbp)."""
        if self.case.torch is None:
            return None
        return self.exc is not None and self.torch_type is not None and \
            isinstance(self.exc, self.torch_type)

    @property
    def names(self) -> bool:
        msg = self.message
        return self.exc is not None and all(
            any(n in msg for n in ((needle,) if isinstance(needle, str) else needle))
            for needle in self.case.needles)

    @property
    def clear(self) -> bool:
        return self.prompt and self.names and (self.sbp_error or self.torch_like)


LIMIT = 5.0


def torch_reference(c: Case) -> type | None:
    """The class of the exception torch raises for the case's mistake (None: torch raises
    nothing, the catalogue is wrong about it)."""
    if c.torch is None or isinstance(c.torch, type):
        return c.torch
    try:
        c.torch()
    except Exception as exc:  # noqa: BLE001 - its class is the answer
        return type(exc)
    return None


def run_case(c: Case, limit: float) -> Result:
    """Run the case in a watcher thread: a hang (no answer in 2 * limit + 2 s) is recorded,
    and its ranks are left behind as daemon threads."""
    box: dict = {}

    def target() -> None:
        t0 = time.monotonic()
        try:
            if c.ranks:
                sf.launch(c.fn, world_size=WORLD, backend="threads", timeout=limit)
            else:
                c.fn()
            box["exc"] = None
        except BaseException as exc:  # noqa: BLE001 - recorded
            box["exc"] = exc
        box["t"] = time.monotonic() - t0

    t0 = time.monotonic()
    th = threading.Thread(target=target, name=f"bad-input {c.name}", daemon=True)
    th.start()
    th.join(2 * limit + 2)
    if th.is_alive():
        return Result(c, None, time.monotonic() - t0, True, torch_reference(c))
    return Result(c, box["exc"], box["t"], False, torch_reference(c))


def _yn(v: bool | None) -> str:
    return "n/a" if v is None else "yes" if v else "no"


def report(results: list[Result], verbose: bool) -> None:
    w = max(len(r.case.name) for r in results)
    print(f"{'case':{w}s}  {'exception':24s} {'s':>6s}  sbp-error  torch-type  names-layout")
    for r in results:
        kind = "HANG" if r.hung else ("-" if r.exc is None else type(r.exc).__name__)
        print(f"{r.case.name:{w}s}  {kind:24s} {r.seconds:6.2f}  {_yn(r.sbp_error):9s}  "
              f"{_yn(r.torch_like):10s}  {_yn(r.names)}")
        if verbose and r.exc is not None:
            print(f"    {r.message[:300]}")
    print()
    print(f"bad inputs: {len(results)}; raised promptly: {sum(r.prompt for r in results)}; "
          f"as sf.SbpError: {sum(r.sbp_error for r in results)}; naming shapes/layouts: "
          f"{sum(r.names for r in results)}")
    unclear = [r for r in results if not r.clear]
    if unclear:
        print(f"\nno error, a hang, or an unclear error ({len(unclear)}):")
    for r in unclear:
        if r.hung or r.exc is None:
            why = "hung" if r.hung else "no error"
        else:
            missing = [n for n in r.case.needles if not any(
                s in r.message for s in ((n,) if isinstance(n, str) else n))]
            parts = [] if r.prompt else [f"slow ({r.seconds:.1f} s)"]
            if not (r.sbp_error or r.torch_like):
                ref = f" nor torch's {r.torch_type.__name__}" if r.torch_type else ""
                parts.append(f"{type(r.exc).__name__}: not an SbpError{ref}")
            if missing:
                parts.append(f"message lacks {missing}")
            why = "; ".join(parts) + f": {r.message[:160]!r}"
        print(f"  {r.case.name}: {why}")
    bad_refs = [r.case.name for r in results if r.case.torch is not None and
                r.torch_type is None]
    if bad_refs:
        print(f"\n(catalogue: plain torch raises nothing for {bad_refs})")


def main() -> None:
    global LIMIT
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="run the cases whose name contains this")
    ap.add_argument("--limit", type=float, default=5.0,
                    help="seconds: a case raising later is not prompt (also the collective "
                         "timeout)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each message")
    args = ap.parse_args()
    LIMIT = args.limit
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # launch's warnings about ranks left behind: in the table
    cases = [c for c in CASES if args.only in c.name]
    t0 = time.monotonic()
    results = [run_case(c, args.limit) for c in cases]
    report(results, args.verbose)
    print(f"\n({time.monotonic() - t0:.1f} s, {WORLD} ranks, threads backend)", file=sys.stderr)


if __name__ == "__main__":
    main()
