"""The command line: `sbpflow run` and `sbpflow demo`."""

import pathlib
import subprocess
import sys

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


def test_demo_runs_and_checks_bytes(capsys):
    main(["demo"])
    out = capsys.readouterr().out
    assert "WRONG" not in out and "!=" not in out
    assert out.count("== planned") == 11


@pytest.mark.gloo
def test_run_torch_backend_example():
    res = subprocess.run([sys.executable, "-m", "sbpflow", "run", "-n", "4", "--backend", "torch",
                          str(ROOT / "examples" / "boxing_tour.py")], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "total 120 B moved" in res.stdout
