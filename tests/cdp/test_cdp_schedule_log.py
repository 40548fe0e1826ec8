"""A trainer's stats come from counts it keeps for every time step, and its task records only
for the first ``timeline_windows`` windows (`schedule_stats.ScheduleLog`): the stats equal
those computed from every task's record, in each mode; memory does not grow with the
records of a long run; `save_timeline` refuses steps it has no records of."""

import pytest

import sbpflow as sf
from cdp_fns import batches, loss_fn, make_stages, sgd
from sbpflow.parallel.cdp import CyclicDataParallel, cycles, ranks_needed, rules

N = 3


def _from_records(records: list, n_ranks: int) -> dict:
    """The schedule's stats by their definitions (docs/cdp.md, 'Stats'), from every record
    of every rank: live (micro-batch, stage) units from each F's step to its B's (to the
    last step while the B has not run), B tasks a step, the busiest rank's ops a step."""
    end = max(r.step for r in records)
    first = {(r.worker, r.stage, r.cycle): r.step for r in records if r.kind == "F"}
    last = {(r.worker, r.stage, r.cycle): r.step for r in records if r.kind == "B"}
    live = cycles.live_profile((k, last.get(key, end)) for key, k in first.items())
    chunks: dict = {}
    cells: dict = {}
    for r in records:
        if r.kind == "B":
            chunks[r.step] = chunks.get(r.step, 0) + 1
        if r.kind in "FB":
            cells[(r.rank, r.step)] = cells.get((r.rank, r.step), 0) + 1
    longest: dict = {}
    for (_, k), c in cells.items():
        longest[k] = max(longest.get(k, 0), c)
    slots = sum(longest.values()) * n_ranks
    return {"live_activations": live, "peak_live_activations": max(live),
            "max_grad_chunks_per_step": max(chunks.values()),
            "bubble_fraction": 1 - sum(cells.values()) / slots}


@pytest.mark.parametrize("mode,rule", [("single", "v2"), ("dp", "dp"), ("dp", "v2"),
                                       ("pp", "v1"), ("zero", "v2"), ("mp", "v2")])
@pytest.mark.parametrize("flush", [True, False])
def test_stats_equal_those_of_every_record(mode, rule, flush):
    world = ranks_needed(mode, N, rules.timeline_of(rule))

    def fn():
        # a trainer keeping every record, and one keeping the first window's only: its later
        # runs add each plan's tasks as summed once (`ScheduleLog.add_run`)
        t = CyclicDataParallel(make_stages(N), loss_fn, sgd, rule=rule, mode=mode,
                               timeline_windows=None)
        short = CyclicDataParallel(make_stages(N), loss_fn, sgd, rule=rule, mode=mode,
                                   timeline_windows=1)
        for x, y in batches(N, 5):
            t.step(x, y)
            short.step(x, y)
        if flush:
            t.flush()
            short.flush()
        return t.records, t.stats(), len(t.roles.ranks), short.stats()
    res = sf.launch(fn, world_size=world)
    records = [r for recs, _, _, _ in res for r in recs]
    want = _from_records(records, res[0][2])
    for got in (res[0][1], res[0][3]):
        assert got["live_activations"] == want["live_activations"]   # (every step)
        for k in ("peak_live_activations", "max_grad_chunks_per_step"):
            assert got[k] == want[k], k
        assert got["bubble_fraction"] == pytest.approx(want["bubble_fraction"])


def test_a_long_run_keeps_the_first_windows_records_only(tmp_path):
    def fn():
        kept = CyclicDataParallel(make_stages(N), loss_fn, sgd, rule="v2", mode="single")
        every = CyclicDataParallel(make_stages(N), loss_fn, sgd, rule="v2", mode="single",
                                   timeline_windows=None)
        for x, y in batches(N, 12):
            kept.step(x, y)
            every.step(x, y)
        with pytest.raises(sf.errors.PlanError, match=r"steps \(0, 36\) reach past the 30 "
                                                       r"time steps .* first 5 windows"):
            kept.save_timeline(str(tmp_path / "late.png"), steps=(0, 36))
        drawn = kept.save_timeline(str(tmp_path / "first.png"))
        return kept.records, every.records, kept.stats(), every.stats(), drawn
    kept, every, st_kept, st_every, drawn = sf.launch(fn, world_size=1)[0]
    assert max(r.step for r in every) == 12 * 2 * N - 1   # 12 windows of 2N steps
    assert max(r.step for r in kept) == 5 * 2 * N - 1
    untimed = lambda rs: [r[:7] for r in rs]  # noqa: E731 - (two trainers: other times)
    assert untimed(kept) == untimed([r for r in every if r.step < 5 * 2 * N])
    assert st_kept == st_every
    assert len(drawn.labels) == sum(1 for r in kept if r.kind in "FB")


def test_timeline_windows_is_checked():
    def fn():
        for bad in (-1, True, 2.0):
            with pytest.raises(sf.errors.PlanError, match="timeline_windows is a number of "
                                                           "windows >= 0 or None"):
                CyclicDataParallel(make_stages(N), loss_fn, sgd, timeline_windows=bad)
    sf.launch(fn, world_size=1)
