"""The training examples in graph mode (``--graph``, ``--micro-batches``) and the GPT's
pipeline layouts (``--layout pp`` / ``pp-dp``): each graph run's losses equal the eager run's
of the same script and seed (threads backend, 4 ranks, tiny sizes, 2-3 steps), and a pipeline
keeps its schedule's register budget (micro-batches in flight per stage, read from the last
step's timeline). examples/hf_finetune.py: every layout of both models gives plain torch's
losses, and its export loads in transformers with the same greedy sample."""

import contextlib
import io
import pathlib
import runpy
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = {"gpt": ["--d", "16", "--heads", "2", "--seq", "8", "--batch", "8", "--sample", "0"],
        "mlp_digits": ["--hidden", "16"],
        "vgg": ["--image", "8", "--channels", "4", "4", "--batch", "12"],
        "wide_deep": ["--vocab", "64", "--batch", "16"],
        "hf_finetune": ["--d", "16", "--heads", "2", "--seq", "8", "--batch", "8", "--sample", "4",
                        "--lr", "1e-2"]}


@pytest.fixture
def example(monkeypatch):
    """``example(script, argv)``: run ``examples/<script>.py`` with ``argv`` through its own
    ``main`` and ``common.run`` (4 thread ranks); returns (rank 0's TrainResult, stdout)."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def run(script: str, argv: list):
        if script == "mlp_digits":
            pytest.importorskip("sklearn")
        if script == "hf_finetune":
            pytest.importorskip("transformers")
        g = runpy.run_path(str(ROOT / "examples" / f"{script}.py"))
        parse = g.get("parse") or (lambda a: g["arguments"]().parse_args(a))
        args = parse(["--steps", "2", "--no-bar"] + TINY[script] + argv)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            res = g["common"].run(g["main"], args)
        return (res[0] if isinstance(res, tuple) else res), out.getvalue()
    return run


def _losses(res) -> list:
    return [v for _, v in res.losses]


CASES = [("gpt", "dp", []), ("gpt", "2d", ["--micro-batches", "2"]), ("mlp_digits", "tp", []),
         ("vgg", "zero", ["--micro-batches", "3"]), ("wide_deep", "tp", ["--micro-batches", "2"])]


@pytest.mark.parametrize("script,layout,extra", CASES,
                         ids=[f"{s}-{lay}{'-k' if e else ''}" for s, lay, e in CASES])
def test_graph_mode_gives_the_eager_losses(example, script, layout, extra):
    eager, _ = example(script, ["--layout", layout, "--eager"])
    graph, out = example(script, ["--layout", layout, "--graph"] + extra)
    assert eager.mode == "eager" and graph.mode == "graph"
    # one micro-batch replays the eager kernels; k micro-batches sum weighted parts (rounding)
    assert _losses(graph) == pytest.approx(_losses(eager), rel=1e-5, abs=1e-6)
    k = extra[1] if extra else "1"
    assert f"graph mode: {k} micro-batch(es) a step" in out


@pytest.mark.parametrize("layout,schedule,k,peaks", [
    ("pp", "1f1b", 8, {0: 4, 1: 3, 2: 2, 3: 1}),     # stage s of 4 keeps at most 4 - s
    ("pp-dp", "gpipe", 4, {0: 4, 1: 4}),             # every forward before the first backward
])
def test_gpt_pipeline_layouts(example, tmp_path, layout, schedule, k, peaks):
    """The pipelined GPT in graph mode (its default there) gives the eager (serial) run's
    losses, and its last step keeps the schedule's in-flight bound on every stage."""
    eager, _ = example("gpt", ["--layout", layout, "--eager"])
    png = tmp_path / "t.png"
    graph, out = example("gpt", ["--layout", layout, "--schedule", schedule,
                                 "--micro-batches", str(k), "--timeline", str(png)])
    assert graph.mode == "graph" and eager.mode == "eager"
    assert _losses(graph) == pytest.approx(_losses(eager), rel=1e-5, abs=1e-6)
    assert graph.in_flight == peaks
    assert f"{len(peaks)} pipeline stages" in out and f"schedule {schedule}" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.stat().st_size > 1000 and f"timeline of the last step saved to {png}" in out


def test_pipeline_layout_defaults_to_graph_mode_with_8_micro_batches(example):
    res, out = example("gpt", ["--layout", "pp", "--steps", "1"])
    assert res.mode == "graph" and res.steps == 1
    assert "graph mode: 8 micro-batch(es) a step, schedule 1f1b" in out
    assert "layout pp: 4 pipeline stages on ranks 0 | 1 | 2 | 3" in out


def test_graph_options_need_graph_mode(example):
    with pytest.raises(SystemExit, match="--micro-batches, --timeline need graph mode"):
        example("gpt", ["--layout", "dp", "--micro-batches", "2", "--timeline", "x.png"])
    with pytest.raises(SystemExit) as exit_:  # argparse's usage error (positive())
        example("gpt", ["--layout", "dp", "--graph", "--micro-batches", "0"])
    assert exit_.value.code == 2


def test_gpt_split_points(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    split = runpy.run_path(str(ROOT / "examples" / "gpt.py"))["split_points"]
    assert split(4, 4) == ["blocks.1", "blocks.2", "blocks.3"]
    assert split(8, 4) == ["blocks.2", "blocks.4", "blocks.6"]
    assert split(6, 2) == ["blocks.3"]
    assert split(2, 4) == ["blocks.0", "blocks.1", "ln_f"]   # fewer blocks than stages
    assert split(3, 4) == ["blocks.1", "blocks.2", "ln_f"]
    with pytest.raises(SystemExit, match="at most 3 pipeline stages"):
        split(1, 4)


def test_a_layout_the_rank_count_cannot_take_ends_with_its_message(example):
    with pytest.raises(SystemExit, match="layout '2d' needs an even number of ranks >= 4, not 3"):
        example("gpt", ["--layout", "2d", "-n", "3"])


# -- examples/hf_finetune.py: a transformers model in every layout -------------------------------
HF_LAYOUTS = ["dp", "tp", "2d", "zero3", "pp", "auto"]


def _torch_losses(script_globals: dict, args, steps: int) -> list:
    """Plain torch on one device: the same model, AdamW, the corpus' windows in the order of
    `sf.data.DataLoader`'s first epoch (``torch.randperm`` seeded with ``seed``), HF's
    ``labels=`` loss."""
    import copy
    model = copy.deepcopy(args.torch_model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    windows = script_globals["Windows"](args.data, args.seq)
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(args.seed))
    losses = []
    for step in range(steps):
        ids = torch.stack([windows[i] for i in order[step * args.batch:][:args.batch].tolist()])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_hf_finetune_every_layout_trains_as_torch(example, monkeypatch, model):
    """3 AdamW steps in each layout (pp: 2 stages x 2 data-parallel ranks, 1F1B over 2
    micro-batches) equal plain torch's losses at float32 tolerance (a float32 model; HF's loss
    is float32), the loss goes down, and every layout prints a greedy sample of the prompt."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    g = runpy.run_path(str(ROOT / "examples" / "hf_finetune.py"))
    args = g["parse"](["--steps", "3", "--model", model] + TINY["hf_finetune"])
    want = _torch_losses(g, args, 3)
    assert want[-1] < want[0]
    for layout in HF_LAYOUTS:
        extra = ["--micro-batches", "2"] if layout == "pp" else []
        res, out = example("hf_finetune", ["--steps", "3", "--model", model, "--layout", layout]
                           + extra)
        assert _losses(res) == pytest.approx(want, rel=1e-5, abs=1e-5), layout
        assert "sample: 'the " in out, (layout, out)


def test_hf_finetune_export_loads_in_transformers(example, tmp_path):
    """``--export DIR`` (a 2x2 layout): transformers' ``from_pretrained(DIR)`` loads the files,
    and its greedy sample in plain torch is the one sbpflow's generate() printed."""
    pytest.importorskip("safetensors")
    _, out = example("hf_finetune", ["--model", "llama", "--layout", "2d", "--sample", "12",
                                     "--export", str(tmp_path)])
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "config.json").exists()
    sampled = out.split("sample: ")[1].splitlines()[0]
    assert f"from_pretrained({str(tmp_path)!r}) loads it; its sample: {sampled}" in out
