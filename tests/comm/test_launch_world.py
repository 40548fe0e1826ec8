"""`sf.launch` inside an existing world (issue 19, part 5): in a rank of a launched world,
under `sbpflow run` and under torchrun, ``fn`` runs on that world's ranks (never a second world
beside it), every rank gets all ranks' results, and a ``world_size`` that differs from the
world's is refused on every rank with the fix."""

import os
import subprocess
import sys
import threading
import time

import pytest

import sbpflow as sf
from sbpflow.cli import main as cli_main


def _where(tag):
    """(tag, rank, world size, this thread's id, a collective over ranks 0 and 1)."""
    x = sf.arange(8, placement=sf.placement("cpu", [0, 1]), sbp=sf.S(0))
    return tag, sf.rank(), sf.world_size(), threading.get_ident(), float(x.full_tensor().sum())


def test_launch_in_a_rank_runs_fn_on_that_rank():
    def outer():
        me = threading.get_ident()
        return me, sf.launch(_where, world_size=2, args=("a",)), \
            sf.launch(_where, world_size=None, args=("b",))

    results = sf.launch(outer, world_size=2)
    idents = [ident for ident, _, _ in results]
    for _, same, none in results:  # every rank has every rank's result, run on its own thread
        assert same == [("a", r, 2, idents[r], 28.0) for r in range(2)]
        assert none == [("b", r, 2, idents[r], 28.0) for r in range(2)]


def test_results_are_shared_by_reference_on_threads():
    """Rank threads share one process: each rank gets the other ranks' result objects
    themselves (a lock cannot be pickled)."""
    made = {}

    def inner():
        made[sf.rank()] = lock = threading.Lock()
        return lock

    for gathered in sf.launch(lambda: sf.launch(inner, world_size=None), world_size=3):
        assert len(gathered) == 3 and all(g is made[r] for r, g in enumerate(gathered))


def test_a_different_world_size_is_refused_on_every_rank():
    def outer():
        try:
            sf.launch(_where, world_size=4, args=("x",))
        except sf.CommError as exc:
            return str(exc)
        return None

    for r, msg in enumerate(sf.launch(outer, world_size=2)):
        assert msg is not None and f"world_size=4) was called on rank {r} of a world of 2" in msg
        assert "sbpflow run -n 4" in msg and "world_size=2" in msg


def test_a_rank_failing_in_fn_stops_the_world_with_its_error():
    def inner():
        if sf.rank() == 1:
            raise ValueError("rank one is broken")
        return sf.rank()

    t0 = time.monotonic()
    with pytest.raises(ValueError, match="rank one is broken"):
        sf.launch(lambda: sf.launch(inner, world_size=2), world_size=2)
    assert time.monotonic() - t0 < 10   # rank 0 waited for rank 1's result: aborted, not hung


def test_world_size_none_outside_a_world_is_refused():
    with pytest.raises(sf.SbpError, match="give world_size"):
        sf.launch(_where, world_size=None)


SCRIPT = """\
import sys
import sbpflow as sf

def main():
    x = sf.arange(8, placement=sf.placement("cpu", [0, 1]), sbp=sf.S(0))
    return sf.rank(), sf.world_size(), float(x.full_tensor().sum())

if __name__ == "__main__":
    lines = [f"results {sf.launch(main, world_size=2)}"]
    try:
        sf.launch(main, world_size=int(sys.argv[1]))
    except sf.CommError as exc:
        lines.append("refused " + str(exc).split(". ")[0])
    with open(f"{sys.argv[2]}/rank{sf.rank()}.txt", "w") as f:
        f.write("\\n".join(lines))
"""
EXPECTED = [(0, 2, 28.0), (1, 2, 28.0)]


def _check_outputs(out_dir, started_by: str) -> None:
    for r in range(2):
        lines = (out_dir / f"rank{r}.txt").read_text().splitlines()
        assert lines == [f"results {EXPECTED}",
                         f"refused sf.launch(fn, world_size=3) was called on rank {r} of a world "
                         f"of 2 rank(s) started by {started_by}"]


def test_sbpflow_run_threads(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    cli_main(["run", "-n", "2", str(script), "3", str(tmp_path)])
    _check_outputs(tmp_path, "sf.launch or `sbpflow run` (rank threads)")


@pytest.mark.gloo
@pytest.mark.slow
def test_torchrun(tmp_path):
    """Two torchrun processes: sf.launch joins their gloo world (no sf.init in the script) and
    runs main once a process; world_size=3 is refused on both."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script), "3", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    _check_outputs(tmp_path, "torch.distributed: torchrun, `sbpflow run --backend torch`, or "
                             "another launcher that set RANK / WORLD_SIZE")
