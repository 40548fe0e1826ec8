"""A weight tied across pipeline stages (a GPT's LM head tied to its token embedding, the first
and last stage) trains as the tied torch model on one device (float64): 2 and 3 single-rank
stages, eager and graph (1F1B and GPipe, several micro-batches), SGD with momentum and AdamW, 3
steps; data-parallel stages; gloo processes. The weight stays one parameter (on the tie
placement: the two stages' meshes stacked, ``B`` across them), each stage's copy identical; a
checkpoint loads into both copies; ties whose stages cannot hold one layout are refused."""

import pytest
import torch

import sbpflow as sf
from sbpflow.models import gpt_class
from tied_fns import GPT, torch_tied, train_tied

TOL = dict(rtol=1e-9, atol=1e-10)
S2, S3 = (["blocks.1"], [[0], [1]]), (["blocks.1", "ln_f"], [[0], [1], [2]])


def _check(results: list, opt: str, n: int = 4) -> None:
    """Losses and weights equal the torch twin's (every weight trained); the tied weight is one
    parameter whose non-empty shards are identical on every rank; as many parameters as torch."""
    run = results[0]
    t_losses, t_sd = torch_tied(run["sd0"], opt, n)
    torch.testing.assert_close(torch.tensor(run["losses"]), torch.tensor(t_losses), **TOL)
    assert set(run["sd"]) == set(t_sd)
    for k, v in t_sd.items():
        torch.testing.assert_close(run["sd"][k], v, **TOL, msg=lambda m: f"{k}: {m}")
        assert not torch.equal(v, run["sd0"][k]), f"{k} was not trained"
    t_model = gpt_class(torch.nn, torch.nn.functional)(**GPT)
    t_model.head.weight = t_model.tok.weight
    assert run["nparams"] == len(list(t_model.parameters()))
    shards = [r["shard"] for r in results if r["shard"] is not None]
    assert len(shards) == 2 and torch.equal(shards[0], shards[1])
    assert all(r["same"] for r in results)


CASES = [  # (stages, optimizer, micro-batches (0: eager), schedule)
    (S2, "sgd", 0, "1f1b"), (S3, "adamw", 0, "1f1b"), (S2, "adamw", 2, "1f1b"),
    (S2, "sgd", 4, "gpipe"), (S3, "sgd", 3, "gpipe"), (S3, "adamw", 4, "1f1b")]


@pytest.mark.parametrize("stages,opt,k,schedule", CASES,
                         ids=[f"S{len(s[1])}-{o}-{'eager' if k == 0 else f'M{k}-{sch}'}"
                              for s, o, k, sch in CASES])
def test_tied_gpt_trains_as_torch(stages, opt, k, schedule):
    split, ranks = stages
    results = sf.launch(train_tied, world_size=len(ranks), args=(ranks, split, opt, k, schedule))
    _check(results, opt)
    # the copies live on the first and last stage: a 2-row tie placement, B across the rows
    assert results[0]["layout"] == ([ranks[0], ranks[-1]], (sf.B, sf.B))


def test_data_parallel_stages_share_the_tie():
    """2 stages of 2 ranks (replicated, an odd batch): the tie placement is the 2x2 mesh
    [[0, 1], [2, 3]]; the all-reduce of the copies' gradients spans both stages."""
    ranks = [[0, 1], [2, 3]]
    results = sf.launch(train_tied, world_size=4, args=(ranks, ["blocks.1"], "adamw", 2,
                                                        "1f1b", 5, [{"*": sf.B}] * 2))
    assert results[0]["layout"] == (ranks, (sf.B, sf.B))
    t_losses, t_sd = torch_tied(results[0]["sd0"], "adamw", 5)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(t_losses), **TOL)
    for k, v in t_sd.items():
        torch.testing.assert_close(results[0]["sd"][k], v, **TOL)
    shards = [r["shard"] for r in results]
    assert all(torch.equal(shards[0], s) for s in shards)


def test_gloo_processes():
    results = sf.launch(train_tied, world_size=2, backend="torch",
                        args=(S2[1], S2[0], "sgd", 2, "1f1b"))
    _check(results, "sgd")


def _checkpoint() -> list:
    """Save the pipelined tied model's state dict, change the weights by a step, load it back:
    every rank's copy of the tied weight is the saved value again."""
    pl = [sf.placement("cpu", [r]) for r in range(2)]
    model = gpt_class(sf.nn, sf.nn.functional)(**GPT).double()
    model.head.weight = model.tok.weight
    sf.parallel.pipeline(model, pl, split=["blocks.1"])
    saved = model.state_dict()
    with torch.no_grad():
        model.tok.weight.local.add_(1.0)
    model.load_state_dict(saved)
    w = model.head.weight
    return [w is model.tok.weight, w.local.clone(), saved["tok.weight"], saved["head.weight"]]


def test_checkpoint_keeps_one_weight():
    for same, local, tok, head in sf.launch(_checkpoint, world_size=2):
        assert same and torch.equal(tok, head) and torch.equal(local, tok)


# -- refusals --------------------------------------------------------------------------------------
def _errors() -> dict:
    def tied():
        m = gpt_class(sf.nn, sf.nn.functional)(**GPT)
        m.head.weight = m.tok.weight
        return m
    one, two = sf.placement("cpu", [0]), sf.placement("cpu", [1, 2])
    cases = {
        # the copies need one layout: meshes of one shape, one nd-sbp
        "meshes": dict(placements=[one, two], split=["blocks.1"]),
        "rules": dict(placements=[sf.placement("cpu", [0, 3]), two], split=["blocks.1"],
                      rules=[{"*": sf.B}, {"head.weight": sf.S(0), "*": sf.B}]),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            sf.parallel.pipeline(tied(), **kwargs)
        except sf.SbpError as exc:
            out[name] = (type(exc).__name__, str(exc))
    return out


def test_incompatible_ties_are_refused():
    out = sf.launch(_errors, world_size=4)[0]
    kind, msg = out["meshes"]
    assert kind == "ParallelizeError"
    assert "tok.weight = head.weight" in msg and "(1,) vs cpu (2,)" in msg and "untie" in msg
    kind, msg = out["rules"]
    assert kind == "ParallelizeError" and "laid out alike" in msg and "S(0)" in msg, msg
