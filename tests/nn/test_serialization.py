"""sf.save / sf.load: a checkpoint saved in one layout (and world size) resumes in another with
torch's trajectory; replicas are written once; loading reads only the pieces it needs; bad
checkpoints raise sf.SbpError subclasses."""

import json
import os
import zlib

import pytest
import torch

import sbpflow as sf
from sbpflow.nn import serialization
from nn_twin import (LAYOUTS, OPTIMIZERS, assert_close, layout, sf_mlp, sf_train, torch_mlp,
                     torch_train)

# extra layouts (placement ranks, input sbp, rules) for the loading side
OTHER = {
    "w2-split1": ([0, 1], sf.S(0), {"*.weight": sf.S(1), "*": sf.S(0)}),
    "w3-2d": ([[0], [1], [2]], (sf.S(0), sf.B), {"*": (sf.B, sf.S(0))}),
    "w3-partial": ([0, 1, 2], sf.B, {"*": sf.P}),
}


def _layout(name):
    if name in LAYOUTS:
        return (*layout(name), 4)
    ranks, x_sbp, rules = OTHER[name]
    pl = sf.placement("cpu", ranks)
    return pl, x_sbp, rules, pl.size


def _run_saving(path, name, opt_name, steps, dropout=0.0):
    def body():
        sf.manual_seed(0)
        m = sf_mlp(dropout)
        sd0 = m.state_dict()
        pl, x_sbp, rules, _ = _layout(name)
        sf.parallel.apply(m, pl, rules)
        opt = OPTIMIZERS[opt_name][0](m.parameters())
        losses, _ = sf_train(m, opt, pl, x_sbp, steps)
        sf.save(path, m, opt, step=steps, extra={"note": "hi"})
        return sd0, losses
    return sf.launch(body, world_size=_layout(name)[3])[0]


def _run_loading(path, name, opt_name, steps, dropout=0.0):
    def body():
        sf.manual_seed(123)  # other initial weights: the load must overwrite them
        m = sf_mlp(dropout)
        pl, x_sbp, rules, _ = _layout(name)
        sf.parallel.apply(m, pl, rules)
        opt = OPTIMIZERS[opt_name][0](m.parameters())
        opt.param_groups[0]["lr"] = 123.0  # restored from the checkpoint
        info = {}
        step = sf.load(path, m, opt, info=info)
        losses, _ = sf_train(m, opt, pl, x_sbp, steps, first_step=step)
        return step, info, losses, m.state_dict(), opt.param_groups[0]["lr"]
    return sf.launch(body, world_size=_layout(name)[3])[0]


@pytest.mark.parametrize("save_in,load_in,opt_name", [
    ("tp", "w2-split1", "adam"),
    ("hybrid", "dp", "adamw"),
    ("zero", "w3-2d", "sgd"),
    ("w3-partial", "tp", "sgd"),
])
def test_resume_in_another_layout_matches_uninterrupted_torch(tmp_path, save_in, load_in,
                                                              opt_name):
    sd0, first = _run_saving(str(tmp_path), save_in, opt_name, 2)
    step, info, second, final, lr = _run_loading(str(tmp_path), load_in, opt_name, 3)
    assert step == 2 and info == {"extra": {"note": "hi"}, "world_size": _layout(save_in)[3]}
    assert lr != 123.0
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    t_losses, _ = torch_train(tm, OPTIMIZERS[opt_name][1](tm.parameters()), 5)
    assert_close(first + second, t_losses, "losses")
    for k, v in tm.state_dict().items():
        assert_close(final[k], v, k)


def test_resume_restores_the_random_stream(tmp_path):
    """Dropout masks after a resume are those of the uninterrupted run (sbpflow's seed stream
    is saved)."""
    def uninterrupted():
        sf.manual_seed(0)
        m = sf_mlp(dropout=0.3)
        pl, x_sbp, rules = layout("dp")
        sf.parallel.apply(m, pl, rules)
        return sf_train(m, OPTIMIZERS["adam"][0](m.parameters()), pl, x_sbp, 4)[0]

    whole = sf.launch(uninterrupted, world_size=4)[0]
    _, first = _run_saving(str(tmp_path), "dp", "adam", 2, dropout=0.3)
    _, _, second, _, _ = _run_loading(str(tmp_path), "tp", "adam", 2, dropout=0.3)
    assert_close(first + second, whole, "losses")


def test_files_replicas_written_once_and_atomic(tmp_path):
    path = str(tmp_path)
    _run_saving(path, "replicated", "adam", 1)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    gen = manifest["generation"]
    assert _entries(path) == [gen, "manifest.json"]
    files = sorted(os.listdir(os.path.join(path, gen)))
    assert files == ["common.pt"] + [f"rank{r}.{e}" for r in range(4) for e in ("json", "pt")]
    assert sorted(manifest["files"]) == files
    for name in files:  # sizes and checksums recorded while writing
        with open(os.path.join(path, gen, name), "rb") as f:
            data = f.read()
        assert manifest["files"][name] == {"size": len(data), "crc32": zlib.crc32(data)}
    shards = [torch.load(os.path.join(path, gen, f"rank{r}.pt"), weights_only=True)["tensors"]
              for r in range(4)]
    keys = {"model/0.weight", "model/0.bias", "model/2.weight", "model/2.bias"}
    assert set(shards[0]) == keys | {f"optim/{k[6:]}/{s}" for k in keys
                                     for s in ("exp_avg", "exp_avg_sq")}
    assert all(s == {} for s in shards[1:])  # B replicas: only the first rank writes
    assert manifest["world_size"] == 4 and manifest["step"] == 1
    assert manifest["tensors"]["model/0.weight"]["shape"] == [10, 5]
    assert manifest["tensors"]["model/0.weight"]["sbp"] == ["B"]
    # a split layout: every rank writes its own piece, no piece twice, nothing more
    path2 = str(tmp_path / "zero")
    _run_saving(path2, "zero", "sgd", 1)
    with open(os.path.join(path2, "manifest.json")) as f:
        gen2 = os.path.join(path2, json.load(f)["generation"])
    sizes = [sum(t.numel() for t in torch.load(os.path.join(gen2, f"rank{r}.pt"),
                                               weights_only=True)["tensors"].values())
             for r in range(4)]
    assert sum(sizes) == 2 * (50 + 10 + 30 + 3)  # parameters + momentum buffers


def test_load_reads_only_the_pieces_it_needs(tmp_path, monkeypatch):
    path = str(tmp_path)
    _run_saving(path, "zero", "sgd", 1)
    opened = []
    real = serialization._Reader._file

    def spy(self, r):
        opened.append((sf.rank(), r))
        return real(self, r)
    monkeypatch.setattr(serialization._Reader, "_file", spy)

    def body(rules):
        m = sf_mlp()
        sf.parallel.apply(m, sf.placement("cpu", [0, 1, 2, 3]), rules)
        sf.load(path, m)
        return m.state_dict()

    same = sf.launch(body, world_size=4, args=({"*": sf.S(0)},))[0]
    assert sorted(set(opened)) == [(0, 0), (1, 1), (2, 2), (3, 3)]  # each rank its own file
    opened.clear()
    other = sf.launch(body, world_size=4, args=({"*.weight": sf.S(1), "*": sf.B},))[0]
    assert {r for me, r in opened if me == 0} == {0, 1, 2, 3}  # columns span every saved piece
    for k in same:
        assert torch.equal(same[k], other[k])


def test_bad_checkpoints_raise_sbp_errors(tmp_path):
    path = str(tmp_path)
    with pytest.raises(sf.nn.CheckpointError, match="manifest.json is missing"):
        sf.launch(lambda: sf.load(path, sf_mlp()), world_size=1)
    _run_saving(path, "tp", "adam", 1)

    class Wider(sf.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = sf_mlp()

    def wrong_shape():
        m = sf.nn.Sequential(sf.nn.Linear(5, 10), sf.nn.ReLU(), sf.nn.Linear(10, 4))
        sf.parallel.apply(m, sf.placement("cpu", [0, 1]), {"*": sf.S(0)})
        sf.load(path, m)

    with pytest.raises(sf.ShapeError) as exc:
        sf.launch(wrong_shape, world_size=2)
    msg = str(exc.value)
    assert "2.weight" in msg and "(3, 10)" in msg and "(4, 10)" in msg and "S(0)" in msg \
        and "cpu[0,1]" in msg
    with pytest.raises(sf.nn.CheckpointError, match="inner.0.weight"):
        sf.launch(lambda: sf.load(path, Wider()), world_size=1)
    with pytest.raises(sf.nn.CheckpointError, match="no optimizer state"):
        def no_opt():
            sf.manual_seed(0)
            m = sf_mlp()
            sf.save(path + "-noopt", m)
            sf.load(path + "-noopt", m, sf.optim.SGD(m.parameters()))
        sf.launch(no_opt, world_size=2)
    # a rank index edited after the save: its checksum no longer matches
    gen = os.path.join(path, _manifest(path)["generation"])
    _edit_json(os.path.join(gen, "rank1.json"), lambda meta: meta.update(save_id=1))
    with pytest.raises(sf.nn.CheckpointError, match=r"rank1\.json: .*the manifest records"):
        sf.launch(lambda: sf.load(path, sf_mlp()), world_size=1)
    assert issubclass(sf.nn.CheckpointError, sf.SbpError)


def _entries(path):
    """The folder's entries but its writer lock's files (they stay, see checkpoint_files)."""
    return sorted(n for n in os.listdir(path) if n not in ("writer.lock", "writer.wait"))


def _manifest(path):
    with open(os.path.join(path, "manifest.json")) as f:
        return json.load(f)


def _edit_json(path, edit):
    with open(path) as f:
        obj = json.load(f)
    edit(obj)
    with open(path, "w") as f:
        json.dump(obj, f)


def _to_format1(path):
    """Rewrite a checkpoint folder as format 1 wrote it: files at the top, no checksums."""
    m = _manifest(path)
    gen = os.path.join(path, m.pop("generation"))
    for name in os.listdir(gen):
        os.replace(os.path.join(gen, name), os.path.join(path, name))
    os.rmdir(gen)
    for k in ("files", "crc32"):
        del m[k]
    m["format"] = 1
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


def test_format1_checkpoints_still_load_and_are_replaced_cleanly(tmp_path):
    path = str(tmp_path)
    _run_saving(path, "zero", "sgd", 1)
    want = sf.launch(_load_state, world_size=2, args=(path,))[0]
    _to_format1(path)
    assert sf.launch(_load_state, world_size=2, args=(path,))[0] == want  # the legacy reader
    _edit_json(os.path.join(path, "rank1.json"), lambda meta: meta.update(save_id=1))
    with pytest.raises(sf.nn.CheckpointError, match="mixed checkpoint"):
        sf.launch(_load_state, world_size=2, args=(path,))
    # a format-2 save over a format-1 folder: the format-1 files stay as the previous
    # checkpoint (a load that read the old manifest can finish), the next save removes them
    legacy = ["common.pt"] + [f"rank{r}.{e}" for r in range(4) for e in ("json", "pt")]
    _run_saving(path, "zero", "sgd", 1)
    first = _manifest(path)
    assert first["previous"] == ""
    assert _entries(path) == sorted([first["generation"], "manifest.json"] + legacy)
    assert sf.launch(_load_state, world_size=2, args=(path,))[0] == want
    _run_saving(path, "zero", "sgd", 1)
    assert _manifest(path)["previous"] == first["generation"]
    assert _entries(path) == sorted([first["generation"], _manifest(path)["generation"],
                                     "manifest.json"])
    assert sf.launch(_load_state, world_size=2, args=(path,))[0] == want


def test_format1_indexes_without_reductions_load(tmp_path):
    """Format-1 indexes may lack the "partial" field (a value saved whole): they load, as
    before (not a raw KeyError)."""
    path = str(tmp_path)
    _run_saving(path, "zero", "sgd", 1)
    want = sf.launch(_load_state, world_size=2, args=(path,))[0]
    _to_format1(path)
    for r in range(4):
        _edit_json(os.path.join(path, f"rank{r}.json"),
                   lambda meta: [e.pop("partial") for e in meta["entries"].values()])
    assert sf.launch(_load_state, world_size=2, args=(path,))[0] == want


def _load_state(path):
    """Runs in each rank: load the checkpoint into a fresh model and SGD (two ranks, split),
    return the logical values of every parameter and momentum buffer as lists."""
    m = sf_mlp()
    sf.parallel.apply(m, sf.placement("cpu", [0, 1]), {"*": sf.S(0)})
    opt = OPTIMIZERS["sgd"][0](m.parameters())
    sf.load(path, m, opt)
    out = {k: v.tolist() for k, v in m.state_dict().items()}
    for n, p in m.named_parameters():
        out[f"{n}/momentum"] = opt.state[p]["momentum_buffer"].full_tensor().tolist()
    return out


def _gloo_train(path, name, steps, first_step, load):
    """Runs in each gloo process: build, lay out, (load,) train, save."""
    sf.manual_seed(0 if not load else 99)
    m = sf_mlp()
    sd0 = m.state_dict()
    ranks, x_sbp, rules = {"dp2": ([0, 1], sf.S(0), {"*": sf.B}),
                           "zero2": ([0, 1], sf.S(0), {"*": sf.S(0)})}[name]
    pl = sf.placement("cpu", ranks)
    sf.parallel.apply(m, pl, rules)
    opt = OPTIMIZERS["adamw"][0](m.parameters())
    if load:
        first_step = sf.load(path, m, opt)
    losses, norms = sf_train(m, opt, pl, x_sbp, steps, first_step=first_step)
    if not load:
        sf.save(path, m, opt, step=first_step + steps)
    return sd0, losses, norms, m.state_dict()


@pytest.mark.gloo
def test_train_save_and_resume_over_gloo(tmp_path):
    """The same in real processes (torch.distributed, gloo): data parallel with clipping, saved,
    resumed ZeRO-style."""
    path = str(tmp_path)
    sd0, first, norms1, _ = sf.launch(_gloo_train, world_size=2, backend="torch",
                                      args=(path, "dp2", 2, 0, False))[0]
    _, second, norms2, final = sf.launch(_gloo_train, world_size=2, backend="torch",
                                         args=(path, "zero2", 3, None, True))[0]
    tm = torch_mlp()
    tm.load_state_dict(sd0)
    t_losses, t_norms = torch_train(tm, OPTIMIZERS["adamw"][1](tm.parameters()), 5)
    assert_close(first + second, t_losses, "losses")
    assert_close(norms1 + norms2, t_norms, "norms")
    for k, v in tm.state_dict().items():
        assert_close(final[k], v, k)
