"""Boxing speed: sbpflow ``to_global`` vs PyTorch DTensor ``redistribute``, side by side.

Runs 4 gloo processes on this machine. For every 1-D transition among S(0), S(1), B, P and a few
2x2 ones, on 4 MiB and 16 MiB float32 tensors: median of ``--iters`` timed runs after warm-up,
the ratio sbpflow / DTensor, and the bytes sbpflow moved against its plan. Transitions DTensor
refuses are listed as sbpflow-only. Then the threads backend's all-gather of 64 MiB on 4 ranks
against one ``torch.cat`` of the same pieces.

    python benchmarks/boxing.py [--iters 10] [--sizes 4,16] [--quick] [--cases S0:B,S1:B]

sbpflow and DTensor are timed in alternation, an iteration of each in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

import sbpflow as sf

LINE_CASES = [(s, d) for s in ("S0", "S1", "B", "P") for d in ("S0", "S1", "B", "P") if s != d]
MESH_CASES = [(("S0", "S1"), ("B", "B")), (("P", "P"), ("B", "B")), (("S0", "S1"), ("S1", "S0")),
              (("P", "S0"), ("S0", "S1"))]


def _sf_sbp(name: str):
    return {"S0": sf.S(0), "S1": sf.S(1), "B": sf.B, "P": sf.P}[name]


def _dt_placement(name: str):
    from torch.distributed.tensor import Partial, Replicate, Shard
    return {"S0": Shard(0), "S1": Shard(1), "B": Replicate(), "P": Partial()}[name]


def _timed(fn, iters: int) -> float:
    fn()  # warm-up (plans, process groups)
    fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _timed_pair(fa, fb, iters: int) -> tuple[float, float]:
    """Medians of ``fa`` and ``fb`` timed in alternation (each iteration runs both, in turns
    first), so that a change in the machine's load falls on both alike."""
    for f in (fa, fb, fa, fb):  # warm-up (plans, process groups)
        f()
    times: tuple[list, list] = ([], [])
    for i in range(iters):
        for k in ((0, 1) if i % 2 == 0 else (1, 0)):
            dist.barrier()
            t = time.perf_counter()
            (fa, fb)[k]()
            dist.barrier()
            times[k].append(time.perf_counter() - t)
    return statistics.median(times[0]), statistics.median(times[1])


def _bench_rank(cases: list, sizes: list[int], iters: int, cross: bool = True) -> list[dict]:
    """Runs on every gloo rank; returns rank 0's rows (times are medians of barrier-to-barrier)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import logging
    logging.getLogger("torch.distributed.tensor").setLevel(logging.ERROR)
    torch._logging.set_logs(all=logging.ERROR)
    rows = []
    meshes = {1: init_device_mesh("cpu", (4,)), 2: init_device_mesh("cpu", (2, 2))}
    placements = {1: sf.placement("cpu", [0, 1, 2, 3]), 2: sf.placement("cpu", [[0, 1], [2, 3]])}
    for mib in sizes:
        n = int((mib * 2**20 // 4) ** 0.5)
        shape = (n, n)
        for src, dst in cases:
            src_t, dst_t = (src,) if isinstance(src, str) else src, (dst,) if isinstance(dst, str) else dst
            k = len(src_t)
            pl = placements[k]
            x = sf.randn(*shape, placement=pl, sbp=tuple(_sf_sbp(s) for s in src_t), seed=0)
            ssbp = tuple(_sf_sbp(s) for s in src_t)
            dsbp = tuple(_sf_sbp(s) for s in dst_t)
            sf.comm.reset_stats()
            x.to_global(sbp=dsbp)
            moved = sf.comm.stats().sent
            planned = sf.boxing.plan(shape, torch.float32, (pl, ssbp), (pl, dsbp)).nbytes
            dt_time, dt_note = None, ""
            try:
                d = DTensor.from_local(x.local, meshes[k], [_dt_placement(s) for s in src_t],
                                       shape=torch.Size(shape), stride=(n, 1))
                target = [_dt_placement(s) for s in dst_t]
                d.redistribute(meshes[k], target).to_local()
            except Exception as exc:  # DTensor refuses some transitions; say which
                dt_note = f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}"
            if dt_note:
                sf_time = _timed(lambda: x.to_global(sbp=dsbp), iters)
            else:
                sf_time, dt_time = _timed_pair(
                    lambda: x.to_global(sbp=dsbp),
                    lambda: d.redistribute(meshes[k], target).to_local(), iters)
            all_moved = [torch.tensor([moved])]
            gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(4)]
            dist.all_gather(gathered, all_moved[0])
            rows.append(dict(mib=mib, src=src, dst=dst, sf=sf_time, dt=dt_time, note=dt_note,
                             moved=int(sum(g.item() for g in gathered)), planned=planned))
    # across meshes: DTensor has no equivalent
    for mib in sizes if cross else ():
        n = int((mib * 2**20 // 4) ** 0.5)
        a, b = sf.placement("cpu", [0, 1]), sf.placement("cpu", [2, 3])
        for s, d in [("S0", "S0"), ("P", "B"), ("B", "S1")]:
            x = sf.randn(n, n, placement=a, sbp=_sf_sbp(s), seed=0)
            sf_time = _timed(lambda: x.to_global(b, _sf_sbp(d)), iters)
            planned = sf.boxing.plan((n, n), torch.float32, (a, (_sf_sbp(s),)), (b, (_sf_sbp(d),))).nbytes
            rows.append(dict(mib=mib, src=f"[0,1] {s}", dst=f"[2,3] {d}", sf=sf_time, dt=None,
                             note="no DTensor equivalent (across meshes)", moved=planned,
                             planned=planned))
    return rows if dist.get_rank() == 0 else []


def _threads_all_gather(mib: int = 64, iters: int = 5) -> tuple[float, float]:
    """(sbpflow threads all-gather GiB/s per rank, torch.cat GiB/s) for ``mib`` MiB in 4 pieces."""
    pieces = [torch.randn(mib * 2**20 // 16) for _ in range(4)]

    def body():
        c = sf.comm.current()
        mine = pieces[c.rank]
        times = []
        for _ in range(iters + 1):
            c.barrier()
            t = time.perf_counter()
            c.all_gather(mine, (0, 1, 2, 3), [p.shape for p in pieces], assemble=torch.cat)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    t_ag = max(sf.launch(body, world_size=4))
    torch.cat(pieces)
    cat_times = []
    for _ in range(iters):
        t = time.perf_counter()
        torch.cat(pieces)
        cat_times.append(time.perf_counter() - t)
    t_cat = statistics.median(cat_times)
    gib = mib / 1024
    return gib / t_ag, gib / t_cat


def _fmt(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:8.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--sizes", default="4,16", help="tensor sizes in MiB, comma separated")
    ap.add_argument("--quick", action="store_true", help="one size (4 MiB), 3 iterations")
    ap.add_argument("--cases", default="",
                    help="only these transitions, e.g. S0:B,S1:S0 (2x2: S0/S1:B/B), and no "
                         "cross-mesh or threads rows")
    args = ap.parse_args(argv)
    sizes = [4] if args.quick else [int(s) for s in args.sizes.split(",")]
    iters = 3 if args.quick else args.iters
    cases = LINE_CASES + MESH_CASES
    if args.cases:
        cases = [tuple(tuple(side.split("/")) if "/" in side else side
                       for side in c.split(":")) for c in args.cases.split(",")]
    print(f"boxing on 4 gloo processes, float32, median of {iters} (ms); ratio = sbpflow / DTensor")
    rows = sf.launch(_bench_rank, world_size=4, backend="torch", args=(cases, sizes, iters, not args.cases))[0]
    print(f"{'MiB':>4} {'from':>10} {'to':>10} {'sbpflow':>9} {'DTensor':>9} {'ratio':>6} "
          f"{'bytes moved':>12} {'planned':>12}  note")
    worst = 0.0
    for r in rows:
        src = r["src"] if isinstance(r["src"], str) else "(" + ",".join(r["src"]) + ")"
        dst = r["dst"] if isinstance(r["dst"], str) else "(" + ",".join(r["dst"]) + ")"
        ratio = r["sf"] / r["dt"] if r["dt"] else None
        if ratio is not None:
            worst = max(worst, ratio)
        note = r["note"] or ""
        if r["moved"] != r["planned"]:
            note += " BYTES != PLAN"
        print(f"{r['mib']:>4} {src:>10} {dst:>10} {_fmt(r['sf'])} {_fmt(r['dt'])} "
              f"{'-' if ratio is None else f'{ratio:6.2f}':>6} {r['moved']:>12} {r['planned']:>12}  "
              f"{note or ('sbpflow-only' if r['dt'] is None else '')}")
    print(f"worst ratio: {worst:.2f}")
    if args.cases:
        return 0
    ag, cat = _threads_all_gather()
    print(f"threads backend all-gather of 64 MiB on 4 ranks: {ag:.2f} GiB/s per rank; "
          f"torch.cat of the same pieces: {cat:.2f} GiB/s; ratio {ag / cat:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
