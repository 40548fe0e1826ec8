"""The command line: `sbpflow run`, `sbpflow demo` and `sbpflow bench`."""

import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from sbpflow.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_run_threads_runs_the_script_on_every_rank(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("import sys, sbpflow as sf\nsf.init()\n"
                      "x = sf.arange(8, placement=sf.placement('cpu', [0, 1, 2]), sbp=sf.S(0))\n"
                      "print('rank', sf.rank(), 'of', sf.world_size(), sys.argv[1:], x.full_tensor().sum().item())\n")
    main(["run", "-n", "3", str(script), "--flag", "v"])
    out = capsys.readouterr().out
    for r in range(3):
        assert f"rank {r} of 3 ['--flag', 'v'] 28" in out


def test_run_threads_leaves_main_and_argv_as_they_were(tmp_path):
    """Rank threads each run the script as __main__; afterwards the process's __main__ module
    and argv are its own again (a rank's module left as __main__ made later gloo launches
    re-run the script in their workers). Ranks finish in rank order after a collective, so
    the last one to put __main__ back is rarely the one that swapped the original out."""
    script = tmp_path / "s.py"
    script.write_text("import time, sbpflow as sf\nsf.init()\n"
                      "sf.ones(4, placement=sf.placement('cpu', [0, 1, 2, 3]), sbp=sf.S(0))"
                      ".full_tensor()\ntime.sleep(0.02 * sf.rank())\n")
    before, argv = sys.modules["__main__"], list(sys.argv)
    for _ in range(3):
        main(["run", "-n", "4", str(script), "--flag"])
        assert sys.modules["__main__"] is before and sys.argv == argv


def test_demo_runs_and_checks_bytes(capsys, tmp_path):
    """A short demo: the boxing table (every row's value kept and bytes as planned), then the
    GPT trained a few steps: loss lines going down, the communication table, the plot; then
    the pipeline: 1F1B steps and a GPipe step, the in-flight peaks per stage, the timeline."""
    plot, timeline = tmp_path / "loss.png", tmp_path / "timeline.png"
    main(["demo", "--seconds", "60", "--steps", "12", "--plot", str(plot),
          "--pipeline-steps", "2", "--timeline", str(timeline)])
    out = capsys.readouterr().out
    boxing, training = out.split("== 2. training a GPT")
    training, pipeline = training.split("== 3. a pipeline")
    rows = [line for line in boxing.splitlines() if line.rstrip().endswith("  ok")]
    assert len(rows) == 11, boxing
    assert "CHANGED" not in boxing and "!= PLANNED" not in boxing
    # the loss curve: "step loss seconds" lines, the first at step 1
    curve = training.split("step     loss  seconds")[1].split("\n\n")[0].split()
    steps, losses = [int(s) for s in curve[0::3]], [float(v) for v in curve[1::3]]
    assert steps[0] == 1 and steps[-1] == 12 and steps == sorted(steps)
    assert losses[-1] < losses[0] - 0.5  # from ln(28) = 3.33 down within a few steps
    assert "tokens/s" in training and "greedy sample: 'the " in training
    # communication per step: at least the gradients' all-reduce, and a total
    comm = training.split("by collective kind:")[1]
    assert "all_reduce" in comm
    assert re.search(r"total\s+[\d.]+ [KM]iB\s+[\d.]+ [KM]iB", comm)
    # the pipeline: 2 1F1B steps and a GPipe step, loss going down; the register budgets
    lines = re.findall(r"^\s+(1f1b|gpipe)\s+(\d+)\s+(\d+\.\d+)\s+\d+\.\d+", pipeline, re.M)
    assert [(s, int(i)) for s, i, _ in lines] == [("1f1b", 1), ("1f1b", 2), ("gpipe", 1)]
    assert float(lines[-1][2]) < float(lines[0][2])
    assert re.search(r"1f1b\s+4\s+3\s+2\s+1\s", pipeline)
    assert re.search(r"gpipe\s+8\s+8\s+8\s+8\s", pipeline)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in out
    else:
        assert plot.stat().st_size > 1000 and f"loss plot saved to {plot}" in out
        assert timeline.stat().st_size > 1000 and f"saved to {timeline}" in pipeline


@pytest.mark.gloo
def test_run_torch_backend_example():
    res = subprocess.run([sys.executable, "-m", "sbpflow", "run", "-n", "4", "--backend", "torch",
                          str(ROOT / "examples" / "boxing_tour.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "total 120 B moved" in res.stdout
    assert "terminate called" not in res.stderr  # process groups destroyed before teardown


@pytest.mark.gloo
def test_run_torch_backend_stops_the_other_ranks_when_one_fails(tmp_path):
    """Rank 1 raises while the others wait in a collective: the run ends within seconds with
    rank 1's traceback and a non-zero code, not after the collective timeout."""
    script = tmp_path / "fails.py"
    script.write_text("import sbpflow as sf, time\n"
                      "if sf.rank() == 1:\n"
                      "    raise ValueError('rank one is broken')\n"
                      "x = sf.ones(4, placement=sf.placement('cpu', [0, 1, 2, 3]), sbp=sf.P)\n"
                      "x.to_global(sbp=sf.B)\n")
    t0 = time.monotonic()
    # ~5 s unloaded, 25 s on 2 cores beside 4 CPU hogs (four ranks import torch); waiting for
    # the collective timeout would take 300 s
    res = subprocess.run([sys.executable, "-m", "sbpflow", "run", "-n", "4", "--backend",
                          "torch", str(script)], capture_output=True, text=True, timeout=400,
                         cwd=ROOT, env=dict(os.environ, SBPFLOW_TIMEOUT="300"))
    assert res.returncode == 1
    assert "ValueError: rank one is broken" in res.stderr
    assert "sbpflow run: rank 1 failed (exit code 1)" in res.stderr
    assert time.monotonic() - t0 < 120


@pytest.mark.gloo
def test_launch_without_a_main_guard_says_how_to_fix_it(tmp_path):
    """A script calling sf.launch(backend="torch") at module level: every rank process imports
    it again; the run fails at once, and the ranks' error says to add the main guard."""
    script = tmp_path / "no_guard.py"
    script.write_text("import sbpflow as sf\n"
                      "def where():\n"
                      "    return sf.rank()\n"
                      "print(sf.launch(where, world_size=2, backend='torch'))\n")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert res.returncode != 0
    assert "if __name__ == '__main__':" in res.stderr
    assert "died with exit code" in res.stderr


EXAMPLES = [("gpt.py", "2d", "tok/s", []), ("gpt.py", "tp", "sample:", []),
            ("gpt.py", "dp", "graph mode: 2 micro-batch(es)", ["--graph", "--micro-batches", "2"]),
            # 1F1B bounds stage s to min(4 - s, 2); stages 1 and 2 reach theirs only when a
            # second forward comes before the first backward, which a loaded machine may reverse
            ("gpt.py", "pp", re.compile(r"stage 0: 2, stage 1: [12], stage 2: [12], stage 3: 1"),
             ["--micro-batches", "2", "--layers", "4"]),
            ("mlp_digits.py", "tp", "test accuracy", []), ("vgg.py", "2d", "accuracy", []),
            ("wide_deep.py", "tp", "embedding.weight (S(0),)", []),
            ("wide_deep.py", "2d", "graph mode: 1 micro-batch(es)", ["--graph"])]


@pytest.mark.parametrize("script,layout,expect,extra", EXAMPLES,
                         ids=[f"{s[:-3]}-{l}{'-graph' if e else ''}" for s, l, _, e in EXAMPLES])
def test_examples_train_a_few_steps(script, layout, expect, extra, capsys, monkeypatch):
    """Each training example runs (threads backend, 4 ranks) and prints its summary; in graph
    mode also the micro-batches in flight per stage (a pipeline of 2 micro-batches: at most
    min(4 - s, 2) on stage s)."""
    import runpy
    if script == "mlp_digits.py":
        pytest.importorskip("sklearn")
    argv = [script, "--layout", layout, "--steps", "3", "--no-bar"] + extra
    if script == "gpt.py":
        argv += ["--sample", "2", "--d", "32", "--seq", "16"]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "path", list(sys.path))
    runpy.run_path(str(ROOT / "examples" / script), run_name="__main__")
    out = capsys.readouterr().out
    found = expect.search(out) if isinstance(expect, re.Pattern) else expect in out
    assert f" {layout}: 3 steps in " in out and "communication:" in out and found, out


@pytest.mark.gloo
def test_gpt_pipeline_example_on_gloo_processes(tmp_path):
    """`examples/gpt.py --layout pp --backend torch`: 4 gloo processes, one stage each, 1F1B
    over 4 micro-batches; the same summary (losses) as the threads backend's run, the in-flight
    bound, and the timeline written by rank 0."""
    png = tmp_path / "t.png"
    argv = ["--layout", "pp", "--steps", "2", "--no-bar", "--sample", "0", "--d", "16",
            "--heads", "2", "--seq", "8", "--batch", "8", "--micro-batches", "4"]
    runs = {}
    for backend in ("torch", "threads"):
        res = subprocess.run([sys.executable, str(ROOT / "examples" / "gpt.py"), "--backend",
                              backend, "--timeline", str(png)] + argv, capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[backend] = res.stdout
    summary = [re.search(r"gpt pp: 2 steps in .* s, (loss [\d.]+ -> [\d.]+)", out).group(1)
               for out in runs.values()]
    assert summary[0] == summary[1], runs
    assert "stage 0: 4, stage 1: 3, stage 2: 2, stage 3: 1" in runs["torch"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in runs["torch"]
    else:
        assert f"timeline of the last step saved to {png}" in runs["torch"] and png.exists()


def test_calibrate_command_writes_a_cluster_file(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    assert main(["calibrate", "-n", "2", "--backend", "threads", "--out", str(out),
                 "--sizes", "4096,65536", "--group-sizes", "2", "--repeats", "2"]) in (0, None)
    import sbpflow as sf
    c = sf.cost.Cluster.load(str(out))
    # a 2-size, 2-repeat fit on threads may put all the time in alpha (beta clamped at 0)
    assert c.world_size == 2 and min(c.intra) >= 0 and c.intra.alpha + c.intra.beta > 0


@pytest.mark.parametrize("argv,expect", [
    (["examples/mlp_digits.py", "--steps", "0"], "argument --steps: must be above 0, got 0"),
    (["examples/gpt.py", "-n", "-1"], "argument -n/--nproc: must be above 0, got -1"),
    (["examples/cdp_digits.py", "--micro-batch", "0"], "argument --micro-batch: must be above 0"),
    (["examples/vgg.py", "--micro-batches", "x"], "argument --micro-batches: not a number: 'x'"),
])
def test_example_counts_below_one_are_usage_errors(argv, expect, capsys, monkeypatch):
    """Counts of steps, ranks, micro-batches, epochs below 1: argparse's usage error (exit 2),
    not an IndexError / ZeroDivisionError inside the ranks."""
    import runpy
    monkeypatch.setattr(sys, "argv", [argv[0].split("/")[-1]] + argv[1:])
    monkeypatch.setattr(sys, "path", list(sys.path))
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(ROOT / argv[0]), run_name="__main__")
    assert exit_.value.code == 2 and expect in capsys.readouterr().err


def test_run_needs_at_least_one_rank(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "-n", "0", "script.py"])
    assert exit_.value.code == 2
    assert "a run needs at least 1 rank, got 0" in capsys.readouterr().err


def test_bench_runs_the_checkouts_benchmarks(tmp_path, capfd, monkeypatch):
    """`sbpflow bench`: the runnable scripts of benchmarks/ (a fake directory here: the real
    ones take minutes), each in a new process with the arguments given; a failing one makes
    the exit status 1, an unknown name 2."""
    import sbpflow.bench as bench
    assert bench.benchmarks_dir() == ROOT / "benchmarks"
    assert {"boxing", "train_gpt", "pipeline", "loader"} <= set(bench.available(ROOT / "benchmarks"))
    assert "timing" not in bench.available(ROOT / "benchmarks")   # a helper module
    (tmp_path / "ok.py").write_text('"""Prints its arguments."""\nimport sys\n'
                                    'if __name__ == "__main__":\n    print("ok", sys.argv[1:])\n')
    (tmp_path / "bad.py").write_text('"""Fails."""\nif __name__ == "__main__":\n    raise SystemExit(3)\n')
    (tmp_path / "helper.py").write_text("X = 1\n")
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: tmp_path)
    assert main(["bench", "--list"]) == 0
    out = capfd.readouterr().out
    assert "ok   Prints its arguments." in out and "bad  Fails." in out and "helper" not in out
    done = subprocess.run([sys.executable, "-m", "sbpflow", "bench", "nope"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and "no benchmark 'nope'; one of" in done.stderr
    assert main(["bench", "ok", "--args", "--x 1"]) == 0
    assert "== benchmarks/ok.py --x 1\nok ['--x', '1']" in capfd.readouterr().out
    assert main(["bench", "ok", "bad"]) == 1
    assert "sbpflow bench: bad failed" in capfd.readouterr().err
