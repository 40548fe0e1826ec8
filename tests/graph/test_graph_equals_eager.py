"""Graph mode equals eager mode: the example models of `sbpflow.models` trained 3 AdamW steps
(float64, 4 thread ranks) by an `sf.nn.Graph` and eagerly from the same initial state give the
same losses, final weights and optimizer state, in the dp, tp, 2d and zero layouts, with one
micro-batch and with k micro-batches that do not divide the batch (the graph's k micro-batches
== eager on the whole batch)."""

import pytest
import torch

import sbpflow as sf
from graph_fns import graph_vs_eager

TOL = dict(rtol=1e-9, atol=1e-9)

# (model, layout, micro-batches, batch): k = 3 splits 20 rows on 4 ranks (S(0)) into 8, 8, 4
# and 10 replicated rows (tp) into 4, 3, 3, 10 rows over the 2 groups of 2d into 4, 4, 2
CASES = [("gpt", lay, k, n) for lay, n in (("dp", 20), ("tp", 10), ("2d", 10), ("zero", 20))
         for k in (1, 3)]
# the other models in dp and tp with 2 uneven micro-batches: 12 + 8 rows (dp), 5 + 4 (tp)
CASES += [(m, lay, 2, n) for m in ("mlp", "vgg", "wide_deep") for lay, n in (("dp", 20),
                                                                               ("tp", 9))]


def _close(a, b, what: str) -> None:
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64),
                               torch.as_tensor(b, dtype=torch.float64), **TOL,
                               msg=lambda m: f"{what}: {m}")


def _check(results: list) -> None:
    """Every rank saw the same losses; graph == eager in losses, weights, optimizer state."""
    for r in results[1:]:
        assert r["graph"]["losses"] == results[0]["graph"]["losses"]
    eager, graph = results[0]["eager"], results[0]["graph"]
    _close(graph["losses"], eager["losses"], "losses")
    assert set(graph["sd"]) == set(eager["sd"])
    for k, v in eager["sd"].items():
        _close(graph["sd"][k], v, f"weight {k}")
    es, gs = eager["opt"]["state"], graph["opt"]["state"]
    assert set(gs) == set(es) and len(es) == len(eager["sd"])  # every parameter was updated
    for i, entry in es.items():
        assert set(gs[i]) == set(entry) == {"step", "exp_avg", "exp_avg_sq"}
        for key, v in entry.items():
            _close(gs[i][key], v, f"optimizer state {i}.{key}")
        assert float(gs[i]["step"]) == 3.0
    # traced on the first call (once a distinct micro-batch shape), replayed after
    assert graph["builds"] == [graph["builds"][0]] * 3 and 1 <= graph["builds"][0] <= 2


@pytest.mark.parametrize("model,lay,k,n", CASES, ids=[f"{m}-{lay}-k{k}" for m, lay, k, n
                                                      in CASES])
def test_graph_equals_eager(model, lay, k, n):
    _check(sf.launch(graph_vs_eager, world_size=4, args=(model, lay, k, n)))


def test_split_inputs_named_when_a_non_batch_input_has_the_batch_size():
    """A batch of 8 sequences of 8 tokens: the positions (8,) have the batch size too, so the
    default would cut them; ``set_split_inputs(True, False, True)`` keeps them whole."""
    _check(sf.launch(graph_vs_eager, world_size=4, args=("gpt", "dp", 2, 8, True)))
