"""Torch's OpInfo database on sbpflow global tensors (issue 35, part 4): a fixed sample of
op_db entries (every `STRIDE`-th float64 entry plus `IMPORTANT` ones) runs its first sample
input on 4 rank threads in layout ``S0`` (``S(0)`` where dim 0 divides by 4, else ``B``);
outputs and the first input's gradient are compared with plain torch (`op_sweep` has the
rules; ``benchmarks/op_coverage.py`` runs every entry, in more layouts, next to DTensor).

Fails on any wrong value, on a failure that ``expected_op_failures.txt`` does not list, and on a
listed failure that now passes (the list must stay true).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest: "
                                          "pip install -e '.[dev]'")

import op_sweep  # noqa: E402  (tests/ops, next to this file)

EXPECTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expected_op_failures.txt")
LAYOUT = "S0"
STRIDE = 13   # every 13th float64 entry of op_db: 52 of 676
IMPORTANT = (
    "addmm", "baddbmm", "matmul", "einsum", "nn.functional.linear", "cat", "where",
    "masked_fill", "gather", "index_select", "scatter_add", "topk", "sort", "cumsum", "isin",
    "sum", "mean", "var", "amax", "softmax", "log_softmax", "nn.functional.layer_norm",
    "nn.functional.cross_entropy", "nn.functional.embedding", "nn.functional.gelu",
    "nn.functional.pad.constant", "reshape", "transpose", "__getitem__",
)
REGENERATE = ("regenerate the list with: .venv/bin/python benchmarks/op_coverage.py "
              "--no-dtensor --layouts S0 --write-expected tests/ops/expected_op_failures.txt")


def sample_ops() -> list:
    """The fixed sample, in op_db order."""
    ops = op_sweep.op_db()
    keys = {op_sweep.entry_key(op) for op in ops[::STRIDE]} | set(IMPORTANT)
    return [op for op in ops if op_sweep.entry_key(op) in keys]


@pytest.fixture(scope="module")
def outcomes() -> dict:
    return {o.key: o for o in op_sweep.sweep(sample_ops(), layouts=(LAYOUT,))}


@pytest.fixture(scope="module")
def expected() -> dict:
    return {k: why for (k, layout), why in op_sweep.read_expected(EXPECTED).items()
            if layout == LAYOUT}


def test_sample_is_fixed_and_runs():
    ops = sample_ops()
    keys = {op_sweep.entry_key(op) for op in ops}
    assert set(IMPORTANT) <= keys, f"not in op_db (renamed?): {set(IMPORTANT) - keys}"
    assert 50 <= len(ops) <= 90


def test_no_wrong_values(outcomes):
    """A wrong value is a silent wrong answer: never expected, always fixed."""
    wrong = [f"{o.key} (sample {o.sample}): {o.detail}" for o in outcomes.values()
             if o.status == "wrong"]
    assert not wrong, f"{len(wrong)} wrong value(s) on {LAYOUT}:\n  " + "\n  ".join(wrong)


def test_failures_are_expected(outcomes, expected):
    new = [f"{o.key}  {LAYOUT}  {op_sweep.reason(o)}" for o in outcomes.values()
           if o.status == "error" and o.key not in expected]
    assert not new, (f"{len(new)} failure(s) not in {os.path.basename(EXPECTED)}: fix them, "
                     f"or add each line with its reason ({REGENERATE}):\n  " + "\n  ".join(new))


def test_expected_failures_still_fail(outcomes, expected):
    passing = [k for k, o in outcomes.items() if o.status == "pass" and k in expected]
    assert not passing, (f"{len(passing)} listed failure(s) now pass: remove their {LAYOUT} "
                         f"lines from {os.path.basename(EXPECTED)} ({REGENERATE}): "
                         + ", ".join(passing))


def test_expected_list_names_real_entries():
    known = {op_sweep.entry_key(op) for op in op_sweep.op_db()}
    table = op_sweep.read_expected(EXPECTED)
    bad = [f"{k} {layout}" for k, layout in table
           if k not in known or layout not in op_sweep.LAYOUTS]
    assert not bad, f"lines naming no float64 op_db entry or no layout: {bad}"
    assert all(why.strip() for why in table.values()), "every expected failure needs a reason"


def test_compare_sees_every_difference():
    """The sweep's comparison itself: values, dtype, shape, structure, non-tensor outputs."""
    import torch
    t = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    same = op_sweep.compare
    assert same(t.clone(), t) is None
    assert same((t.clone(), 3, torch.Size([2])), (t, 3, torch.Size([2]))) is None
    assert same(torch.tensor([float("nan")]), torch.tensor([float("nan")])) is None
    assert same(t + 1e-3, t)                       # value
    assert same(t.float(), t)                      # dtype
    assert same(t.reshape(3, 2), t)                # shape
    assert same((t,), (t, t))                      # structure
    assert same(t, (t,)) and same(1.0, t)          # tensor / not a tensor
    assert same(True, False) and same(2, 3)        # plain values
