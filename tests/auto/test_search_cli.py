"""`sbpflow search`: the table, the baselines, --plot, bad input."""

import pytest

import sbpflow as sf
from sbpflow.auto import search_cli
from sbpflow.cli import main

SMALL = ["search", "--model", "gpt", "--layers", "1", "--d-model", "256", "--heads", "4",
         "--seq", "64", "--batch", "16", "--nodes", "2", "--devices-per-node", "8",
         "--cluster", "dgx-a100", "--no-progress"]


def test_search_prints_table_and_baselines(capsys):
    assert main(SMALL + ["--budget-s", "1", "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert "== found strategy (cd" in out
    for name in ("embed", "h0.qkv", "h0.attn", "h0.proj", "h0.fc1", "h0.fc2", "head"):
        assert f"\n{name} " in out
    assert "time ms" in out and "MB/device" in out
    assert "== data parallel ==" in out
    assert "== best Megatron t x d under memory: tp" in out
    comp = out.split("== comparison ==")[1]
    assert "data parallel" in comp and "Megatron tp" in comp and "found (cd)" in comp
    # the found strategy is never worse than data parallel (cd starts there)
    times = {l.split()[0]: float(l.split()[-6]) for l in comp.strip().split("\n")[1:]}
    assert times["found"] <= times["data"] + 1e-9


def test_search_exhaustive_and_memory_limit(capsys):
    assert main(SMALL + ["--algorithm", "exhaustive", "--memory-limit", "0.05"]) == 0
    out = capsys.readouterr().out
    assert "== found strategy (exhaustive" in out
    assert "memory limit 0.05 GiB/device" in out


def test_search_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "conv.png"
    assert main(SMALL + ["--budget-s", "0.3", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "== convergence ==" in out and "x optimum" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_search_cluster_file(tmp_path, capsys):
    f = tmp_path / "c.json"
    sf.cost.Cluster.preset("dgx-a100", nodes=1).save(f)
    argv = [a for a in SMALL if a not in ("--nodes", "2", "--cluster", "dgx-a100")]
    assert main(argv + ["--cluster-file", str(f), "--budget-s", "0.3"]) == 0
    assert "1 node(s) x 8 device(s)" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["vgg13", "alexnet", "dlrm"])
def test_other_models_build(model):
    g = search_cli.build_graph(model, batch=32)
    assert len(g.layers) > 3


@pytest.mark.parametrize("argv, msg", [
    (["--model", "resnet"], "unknown model 'resnet'"),
    (["--d-model", "250"], "not divisible by --heads"),
    (["--layers", "0"], "--layers must be a positive integer"),
    (["--batch", "-4"], "--batch must be a positive integer"),
    (["--cluster", "nope"], "unknown cluster preset"),
    (["--memory-limit", "-1"], "--memory-limit must be > 0"),
])
def test_bad_input_is_a_clear_error(argv, msg, capsys):
    assert main(SMALL + argv) == 2
    assert msg in capsys.readouterr().err


def test_bad_input_raises_sbp_error():
    with pytest.raises(sf.SbpError, match="unknown model"):
        search_cli.build_graph("resnet")
    with pytest.raises(sf.SbpError, match="cannot read a cluster"):
        search_cli.build_cluster(cluster_file="/nonexistent/cluster.json")


def test_argparse_errors(capsys):
    with pytest.raises(SystemExit) as e:
        main(SMALL + ["--algorithm", "genetic"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(SMALL + ["--layers", "two"])
    assert "invalid int value" in capsys.readouterr().err
