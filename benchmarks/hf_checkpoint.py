"""Hugging Face checkpoints (issue 36, part 5): ``sf.export`` and ``sf.load_pretrained`` of a
GPT-2 built from its config (no download) next to transformers' ``save_pretrained`` /
``from_pretrained`` of the same model, on ``--ranks`` threads ranks in a 2-D ZeRO-3 layout
(a 2 x (ranks/2) mesh, parameters stored split). Prints the seconds of each, the largest
tensor (what the writer rank holds at most: one tensor at a time) and checks that the export's
files and index are save_pretrained's.

With ``--processes``, also on ``--ranks`` gloo processes: a model built on the meta device,
read by ``sf.load_pretrained``, then exported, each process sampling its resident memory
(``/proc/self/statm``, every millisecond): the most each rank's memory grows during the
export (rank 0 writes; the others only send their shards).

    python benchmarks/hf_checkpoint.py [--layers 6] [--width 512] [--vocab 16384] [--ranks 4]
        [--shard 20MB] [--processes]
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import threading
import time

import torch
import transformers

import sbpflow as sf


def _config(a) -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=a.layers, n_embd=a.width, n_head=8,
                                   vocab_size=a.vocab, n_positions=256, bos_token_id=0,
                                   eos_token_id=0)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _export_growth(a, source: str, out: str) -> int:
    """One gloo rank: the model on the meta device, read from ``source`` in 2-D ZeRO-3, then
    exported to ``out``; returns the most its resident memory grew during the export."""
    with torch.device("meta"):
        empty = transformers.GPT2LMHeadModel(_config(a))
    mesh = sf.placement("cpu", list(range(a.ranks)), shape=(2, a.ranks // 2))
    m = sf.load_pretrained(empty, source, mesh, {"*": (sf.B, sf.B)}, zero=3)
    gc.collect()
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.001)
    t = threading.Thread(target=sample)
    t.start()
    sf.export(m, out, max_shard_size=a.shard)
    done.set()
    t.join()
    return max(peak[0], _rss()) - base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--shard", default="20MB", help="max_shard_size")
    ap.add_argument("--processes", action="store_true",
                    help="also measure each gloo rank's memory growth during the export")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(_config(a)).eval()
    sizes = [p.numel() * p.element_size() for p in model.parameters()]
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = os.path.join(tmp, "ours"), os.path.join(tmp, "theirs")
        t = time.perf_counter()
        model.save_pretrained(theirs, max_shard_size=a.shard)
        t_save = time.perf_counter() - t
        mesh = sf.placement("cpu", list(range(a.ranks)), shape=(2, a.ranks // 2))

        def body():
            m = sf.parallel.apply(model, mesh, {"*": (sf.B, sf.B)}, zero=3)
            sf.comm.current().barrier()
            t0 = time.perf_counter()
            sf.export(m, ours, max_shard_size=a.shard)
            t1 = time.perf_counter()
            sf.load_pretrained(m, theirs)
            return t1 - t0, time.perf_counter() - t1

        t_export, t_load = sf.launch(body, world_size=a.ranks)[0]
        t = time.perf_counter()
        transformers.GPT2LMHeadModel.from_pretrained(ours)
        t_from = time.perf_counter() - t
        growth = sf.launch(_export_growth, a.ranks, backend="torch",
                           args=(a, theirs, os.path.join(tmp, "gloo"))) if a.processes else None
        index = "model.safetensors.index.json"
        same = sorted(os.listdir(ours)) == sorted(os.listdir(theirs)) and (
            not os.path.exists(os.path.join(ours, index)) or
            open(os.path.join(ours, index)).read() == open(os.path.join(theirs, index)).read())
    print(f"GPT-2 {a.layers} x {a.width}, vocab {a.vocab}: {sum(sizes) / 1e6:.0f} MB float32, "
          f"largest tensor {max(sizes) / 1e6:.1f} MB; {a.ranks} ranks, mesh {tuple(mesh.shape)}, "
          f"ZeRO-3")
    print(f"save_pretrained (torch)       {t_save:6.2f} s")
    print(f"sf.export                     {t_export:6.2f} s   files and index as save_pretrained's: "
          f"{same}")
    print(f"from_pretrained of the export {t_from:6.2f} s")
    print(f"sf.load_pretrained            {t_load:6.2f} s")
    if growth is not None:
        print("resident memory growth during sf.export, MB per gloo rank: "
              + ", ".join(f"rank {r}: {g / 1e6:.1f}" for r, g in enumerate(growth)))


if __name__ == "__main__":
    main()
