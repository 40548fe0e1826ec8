"""Checkpoints in the Hugging Face format (issue 36, part 5): `sf.export` after a training step
in a layout loads with ``from_pretrained`` equal to the torch twin's step (state dict, logits)
and writes what ``save_pretrained`` writes (files, index, config); ``save_pretrained``'s files
read by `sf.load_pretrained` into split, 2-D and ZeRO-3 layouts (uneven parts) and into models
built on the meta device equal the saved values, each rank reading only its shards' regions;
errors name what does not fit. Tiny float64 models (tests/hf/hf_zoo.py), 4 rank threads (3 for
uneven parts), nothing downloaded."""

import json
import os
import threading
import weakref

import pytest
import torch

import sbpflow as sf
from sbpflow.nn import safetensors_io
from sbpflow.sbp import shard_box

import hf_zoo
from hf_zoo import transformers

safetensors = pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file  # noqa: E402

# the layouts split weights every which way to test reading, not to run fast
pytestmark = pytest.mark.filterwarnings("ignore::sbpflow.nn.CostlyLayoutWarning")
MESH = [[0, 1], [2, 3]]
# layout: (mesh ranks, parameter rules, ZeRO stage, input sbp)
LAYOUTS = {
    "dp": ([0, 1, 2, 3], {"*": sf.B}, 0, (sf.S(0),)),
    "split": ([0, 1, 2, 3], {"*.weight": sf.S(0), "*": sf.B}, 0, (sf.B,)),
    "2x2": (MESH, {"*.weight": (sf.B, sf.S(0)), "*": (sf.B, sf.B)}, 0, (sf.S(0), sf.B)),
    "2x2-zero3": (MESH, {"*": (sf.B, sf.B)}, 3, (sf.S(0), sf.B)),
}


def _auto_class(name):
    return transformers.AutoModelForMaskedLM if name == "bert" else \
        transformers.AutoModelForCausalLM


def _torch_step(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model


@pytest.mark.parametrize("name,layout", [("gpt2", "dp"), ("gpt2", "2x2-zero3"),
                                         ("llama", "split"), ("bert", "2x2")])
def test_export_after_a_step_loads_in_transformers(tmp_path, name, layout):
    """One SGD step in the layout, exported: ``from_pretrained`` gives the torch twin's state
    dict and logits. The causal LMs' loss is float32 (transformers upcasts the logits), so their
    step matches at float32 tolerance; BERT's is float64."""
    ranks, rules, zero, data_sbp = LAYOUTS[layout]
    model, ids = hf_zoo.build(name), hf_zoo.token_ids()
    twin = _torch_step(hf_zoo.build(name), ids)

    def body():
        pl = sf.placement("cpu", ranks)
        m = sf.parallel.apply(model, pl, rules, zero=zero)
        opt = sf.optim.SGD(m.parameters(), lr=0.5)
        x = sf.tensor(ids, placement=pl, sbp=data_sbp)
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        return sf.export(m, str(tmp_path))

    files = sf.launch(body, world_size=4)[0]
    assert files == ["model.safetensors"]
    assert {"config.json", "model.safetensors"} <= set(os.listdir(tmp_path))
    assert ("generation_config.json" in os.listdir(tmp_path)) == (name != "bert")
    back = _auto_class(name).from_pretrained(str(tmp_path))
    tol = dict(rtol=0, atol=1e-12) if name == "bert" else dict(rtol=0, atol=1e-6)
    got, want = back.state_dict(), twin.state_dict()
    assert list(got) == list(want) and back.dtype == torch.float64
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(back(input_ids=ids).logits, twin(input_ids=ids).logits,
                                   **tol)


def _one_at_a_time(monkeypatch):
    """Make the export's gathers assert that rank 0 holds no earlier gathered tensor still."""
    real, alive = safetensors_io._gather, []

    def gather(t):
        if sf.rank() == 0:
            assert all(r() is None for r in alive), "an earlier whole tensor is still held"
        value = real(t)
        if value is not None:
            alive.append(weakref.ref(value))
        return value
    monkeypatch.setattr(safetensors_io, "_gather", gather)
    return alive


@pytest.mark.parametrize("name,dtype", [(n, torch.float64) for n in hf_zoo.ZOO]
                         + [("gpt2", torch.bfloat16)], ids=list(hf_zoo.ZOO) + ["gpt2-bf16"])
def test_sharded_export_writes_what_save_pretrained_writes(tmp_path, monkeypatch, name, dtype):
    """Above max_shard_size: the same shard files (tensors, values), byte-equal index and
    equal config as ``save_pretrained`` of the same model; tied weights once (GPT-2's
    lm_head, BERT's decoder weight and bias); GPT-NeoX's lm_head under its original name
    ``embed_out`` (transformers 5 renames it on load and back on save, and then writes in
    natural order); only rank 0 receives data (the others send their shards) and holds one
    whole tensor at a time; ``from_pretrained`` reads it back."""
    model = hf_zoo.build(name, dtype=dtype)
    gathered = _one_at_a_time(monkeypatch)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    os.makedirs(ours)
    (ours / "model.safetensors").write_bytes(b"stale")   # an earlier unsharded export
    model.save_pretrained(str(theirs), max_shard_size="8KB")

    def body():
        m = sf.parallel.apply(model, sf.placement("cpu", MESH), {"*": (sf.S(0), sf.B)},
                              zero=3)
        sf.comm.reset_stats()
        files = sf.export(m, str(ours), max_shard_size="8KB")
        return files, sf.comm.stats()["p2p"].recv, sum(p.local.nbytes for p in m.parameters())

    out = sf.launch(body, world_size=4)
    files = out[0][0]
    assert len(files) > 1 and sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    index = "model.safetensors.index.json"
    assert (ours / index).read_text() == (theirs / index).read_text()
    assert json.loads((ours / "config.json").read_text()) == \
        json.loads((theirs / "config.json").read_text())
    for f in files:
        a, b = load_file(str(ours / f)), load_file(str(theirs / f))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        with safetensors.safe_open(str(ours / f), "pt") as h:
            assert h.metadata() == {"format": "pt"}
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert [r[1] for r in out] == [total - out[0][2], 0, 0, 0]
    assert len(gathered) == len(json.loads((ours / index).read_text())["weight_map"])
    back = _auto_class(name).from_pretrained(str(ours))
    assert back.dtype == dtype
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())


def test_pipeline_stages_export_and_load(tmp_path):
    """A 2-stage pipeline whose first stage is on ranks 2, 3 (rank 0, the writer, holds none of
    it) and whose tied embedding / lm_head lies on the stages' stacked placement: the export
    equals the model, and ``save_pretrained``'s files load back into the stages."""
    model, other = hf_zoo.build("gpt2"), hf_zoo.build("gpt2", seed=7)
    other.save_pretrained(str(tmp_path / "other"))

    def body():
        pls = [sf.placement("cpu", [2, 3]), sf.placement("cpu", [0, 1])]
        m = sf.parallel.pipeline(sf.nn.from_torch(model), pls, split=["transformer.h.1"],
                                 rules=[{"*": sf.S(0)}, {"*": sf.S(0)}])
        assert m.transformer.wte.weight.placement.ndim == 2   # the tie placement
        sf.export(m, str(tmp_path / "ours"))
        sf.load_pretrained(m, str(tmp_path / "other"))
        return {k: t.full_tensor() for k, t in m.state_dict(keep_vars=True).items()}

    values = sf.launch(body, world_size=4)[0]
    back = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "ours"))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in back.state_dict().items())
    assert all(torch.equal(values[k], v) for k, v in other.state_dict().items())


# -- reading Hugging Face checkpoints into layouts ------------------------------------------------
READ_LAYOUTS = {   # name: (mesh ranks, rules, ZeRO stage)
    "S0-uneven": ([0, 1, 2], {"*": sf.S(0)}, 0),
    "S1-uneven": ([0, 1, 2], {"*ln_*": sf.S(0), "*.bias": sf.S(0), "*": sf.S(1)}, 0),
    "2x2": (MESH, {"*ln_*": (sf.S(0), sf.B), "*norm*": (sf.B, sf.S(0)), "*.bias": (sf.S(0), sf.B),
                   "*": (sf.S(1), sf.S(0))}, 0),
    "2x2-zero3": (MESH, {"*": (sf.B, sf.B)}, 3),
}


def _saved(tmp_path, name, **kw):
    model = hf_zoo.build(name)
    model.save_pretrained(str(tmp_path), **kw)
    return model


@pytest.mark.parametrize("layout", list(READ_LAYOUTS))
def test_load_pretrained_into_layouts(tmp_path, layout):
    """``save_pretrained`` (sharded) -> `sf.load_pretrained` into a differently seeded model in
    the layout: every tensor equals the saved one, and so do the logits."""
    ranks, rules, zero = READ_LAYOUTS[layout]
    saved = _saved(tmp_path, "gpt2", max_shard_size="20KB")
    fresh, ids = hf_zoo.build("gpt2", seed=7), hf_zoo.token_ids()
    n = len(sf.placement("cpu", ranks).flat_ranks)

    def body():
        pl = sf.placement("cpu", ranks)
        m = sf.load_pretrained(fresh, str(tmp_path), pl, rules, zero=zero)
        values = {k: t.full_tensor() for k, t in m.state_dict(keep_vars=True).items()}
        logits = m(input_ids=sf.tensor(ids, placement=pl, sbp=(sf.B,) * pl.ndim)).logits
        return values, logits.full_tensor()

    values, logits = sf.launch(body, world_size=n)[0]
    want = saved.state_dict()
    assert list(values) == list(want)
    assert all(torch.equal(values[k], want[k]) for k in want)
    with torch.no_grad():
        torch.testing.assert_close(logits, saved(input_ids=ids).logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "gpt_neox"])
def test_load_pretrained_into_a_model_built_on_the_meta_device(tmp_path, name):
    """A model built under ``torch.device("meta")`` (no values anywhere) is laid out by its
    shards alone and filled from the checkpoint (GPT-NeoX's ``embed_out`` read as its
    ``lm_head``, as transformers renames it); its non-persistent buffers (rotary frequencies,
    BERT's position ids) are computed as transformers computes them: the logits equal the
    saved model's (Llama's RMSNorm computes in float32: float32 tolerance).
    `sf.parallel.apply` alone refuses such a model, naming load_pretrained."""
    saved, ids = _saved(tmp_path, name), hf_zoo.token_ids()
    with torch.device("meta"):
        empty = hf_zoo.build(name)
    rules = {"*": (sf.B, sf.B)}

    def body():
        pl = sf.placement("cpu", MESH)
        m = sf.load_pretrained(empty, str(tmp_path), pl, rules, zero=3)
        logits = m(input_ids=sf.tensor(ids, placement=pl, sbp=(sf.S(0), sf.B))).logits
        return {k: t.full_tensor() for k, t in m.state_dict(keep_vars=True).items()}, \
            logits.full_tensor()

    values, logits = sf.launch(body, world_size=4)[0]
    assert all(p.is_meta for p in empty.parameters())
    assert all(torch.equal(values[k], v) for k, v in saved.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(logits, saved(input_ids=ids).logits, rtol=0,
                                   atol=1e-6 if name == "llama" else 1e-12)
    with pytest.raises(sf.ShapeError, match="meta device.*sf.load_pretrained"):
        sf.launch(lambda: sf.parallel.apply(empty, sf.placement("cpu", [0, 1]), rules),
                  world_size=2)


class _Recorder:
    """``safetensors.safe_open`` that records, per rank, each region read and its bytes."""

    def __init__(self, real):
        self.real, self.reads, self.lock = real, {}, threading.Lock()

    def __call__(self, path, framework, **kw):
        return _Handle(self, self.real(path, framework, **kw))


class _Handle:
    def __init__(self, rec, handle):
        self.rec, self.h = rec, handle

    def __enter__(self):
        self.h.__enter__()
        return self

    def __exit__(self, *exc):
        return self.h.__exit__(*exc)

    def keys(self):
        return self.h.keys()

    def get_tensor(self, name):
        raise AssertionError(f"get_tensor({name!r}) reads a whole tensor")

    def get_slice(self, name):
        return _Slice(self.rec, name, self.h.get_slice(name))


class _Slice:
    def __init__(self, rec, name, s):
        self.rec, self.name, self.s = rec, name, s

    def get_shape(self):
        return self.s.get_shape()

    def get_dtype(self):
        return self.s.get_dtype()

    def __getitem__(self, index):
        out = self.s[index]
        box = tuple((sl.start, sl.stop - sl.start) for sl in index)
        with self.rec.lock:
            self.rec.reads.setdefault(sf.rank(), []).append((self.name, box, out.nbytes))
        return out


@pytest.mark.parametrize("layout", ["S0-uneven", "2x2"])
def test_each_rank_reads_only_its_shards(tmp_path, monkeypatch, layout):
    """Each rank reads, through ``get_slice``, exactly the region of each tensor that
    DESIGN.md's local shard gives it (balanced parts, uneven sizes, 2-D meshes), once, and
    never a whole tensor (``get_tensor``): its bytes read are its shards' bytes."""
    ranks, rules, _ = READ_LAYOUTS[layout]
    _saved(tmp_path, "llama", max_shard_size="20KB")
    fresh = hf_zoo.build("llama", seed=7)
    rec = _Recorder(safetensors.safe_open)
    monkeypatch.setattr(safetensors, "safe_open", rec)
    pl = sf.placement("cpu", ranks)

    def body():
        m = sf.load_pretrained(fresh, str(tmp_path), pl, rules)
        coord = pl.coord_of(sf.rank())
        return {k: shard_box(tuple(t.shape), pl.shape, t.sbp, coord)
                for k, t in m.state_dict(keep_vars=True).items()}, \
            sum(t.local.nbytes for t in m.state_dict(keep_vars=True).values())

    out = sf.launch(body, world_size=len(pl.flat_ranks))
    for r, (boxes, nbytes) in enumerate(out):
        got = sorted((k, b) for k, b, _ in rec.reads[r])
        want = sorted((k, b) for k, b in boxes.items() if all(n for _, n in b))
        assert got == want, f"rank {r}"
        assert sum(n for _, _, n in rec.reads[r]) == nbytes


def test_base_model_checkpoint_into_a_model_with_a_head(tmp_path):
    """A base model's checkpoint (GPT2Model: no ``transformer.`` prefix) fills GPT2LMHeadModel
    as transformers does: names found without the ``base_model_prefix``; the tied lm_head
    takes the embedding; float32 values are cast to the float64 model's dtype."""
    base = hf_zoo.build("gpt2", dtype=torch.float32).transformer
    base.save_pretrained(str(tmp_path))
    fresh = hf_zoo.build("gpt2", seed=7)

    def body():
        m = sf.load_pretrained(fresh, str(tmp_path), sf.placement("cpu", [0, 1]),
                               {"*": sf.S(0)})
        return {k: t.full_tensor() for k, t in m.state_dict(keep_vars=True).items()}

    values = sf.launch(body, world_size=2)[0]
    want = {k: v.double() for k, v in base.state_dict().items()}
    assert values["lm_head.weight"].dtype == torch.float64
    assert all(torch.equal(values[f"transformer.{k}"], v) for k, v in want.items())
    assert torch.equal(values["lm_head.weight"], want["wte.weight"])


# -- errors ---------------------------------------------------------------------------------------
def _load_error(path, model, strict=True):
    def body():
        info = {}
        m = sf.load_pretrained(model, str(path), sf.placement("cpu", [0, 1]), {"*": sf.S(0)},
                               strict=strict, info=info)
        return info, m.transformer.wpe.weight.full_tensor()
    return sf.launch(body, world_size=2)


def test_load_errors_name_the_tensors(tmp_path):
    """A missing tensor, an unexpected one and a shape mismatch raise (on every rank) a
    `CheckpointKeyError` / `CheckpointShapeError` naming them; strict=False loads the rest
    and reports the names."""
    saved = hf_zoo.build("gpt2")
    sd = {k: v for k, v in saved.state_dict().items() if k != "lm_head.weight"}
    wpe = sd.pop("transformer.wpe.weight")
    save_file({**sd, "transformer.extra": torch.zeros(3)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    fresh = hf_zoo.build("gpt2", seed=7)
    with pytest.raises(sf.errors.CheckpointKeyError, match=r"transformer\.wpe\.weight.*"
                       r"transformer\.extra") as err:
        _load_error(tmp_path, fresh)
    assert isinstance(err.value, sf.errors.StateDictError)
    (info, w), _ = _load_error(tmp_path, fresh, strict=False)
    assert info == {"missing": ["transformer.wpe.weight"], "unexpected": ["transformer.extra"]}
    assert torch.equal(w, fresh.transformer.wpe.weight)   # left as it was
    save_file({**sd, "transformer.wpe.weight": wpe[:8]}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(sf.errors.CheckpointShapeError, match=r"'transformer\.wpe\.weight': \(8, 16\) "
                       r"in the checkpoint .*\(32, 16\) in the model"):
        _load_error(tmp_path, fresh)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(sf.CheckpointError, match="holds no Hugging Face checkpoint"):
        _load_error(tmp_path, fresh)


def test_export_of_an_sbpflow_model(tmp_path):
    """A model of sf.nn layers (no transformers config) exports its weights alone, under its
    state-dict names, with the metadata given; safetensors reads them back."""
    def body():
        sf.manual_seed(0)
        pl = sf.placement("cpu", [0, 1, 2])
        m = sf.parallel.apply(sf.nn.Sequential(sf.nn.Linear(5, 7), sf.nn.Linear(7, 2)), pl,
                              {"0.*": sf.S(0), "*": sf.B})
        sf.export(m, str(tmp_path), metadata={"step": "3"})
        return m.state_dict()

    want = sf.launch(body, world_size=3)[0]
    assert os.listdir(tmp_path) == ["model.safetensors"]
    got = load_file(str(tmp_path / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with safetensors.safe_open(str(tmp_path / "model.safetensors"), "pt") as h:
        assert h.metadata() == {"format": "pt", "step": "3"}


def test_a_failed_write_raises_on_every_rank_and_leaves_no_file(tmp_path, monkeypatch):
    """Rank 0's write failing midway (a full disk, say) raises on every rank, after the other
    ranks' gathers ran to the end (none waits for rank 0), and leaves no file, not even a
    partial one; a folder path that is a file fails before anything is gathered."""
    real, calls = safetensors_io.StreamWriter.write, []

    def write(self, value):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        real(self, value)
    monkeypatch.setattr(safetensors_io.StreamWriter, "write", write)
    model = hf_zoo.build("gpt2")

    def body(path):
        m = sf.parallel.apply(model, sf.placement("cpu", [0, 1]), {"*": sf.S(0)})
        try:
            sf.export(m, path)
        except sf.CheckpointError as exc:
            return str(exc)

    for text in sf.launch(body, world_size=2, args=(str(tmp_path / "out"),)):
        assert "rank 0 could not write" in text and "No space left" in text
    assert os.listdir(tmp_path / "out") == []
    (tmp_path / "file").write_text("")
    assert all("rank 0" in text and "File exists" in text
               for text in sf.launch(body, world_size=2, args=(str(tmp_path / "file"),)))
    assert len(calls) == 3   # no write after the failed one, none for the second export


def test_export_errors(tmp_path):
    """A torch model (not laid out), a bad max_shard_size, and a model without a layout given
    to load_pretrained are refused, saying what to do."""
    model = hf_zoo.build("gpt2")
    with pytest.raises(sf.CheckpointError, match="must be an sf.nn.Module"):
        sf.launch(lambda: sf.export(model, str(tmp_path)), world_size=1)
    with pytest.raises(sf.CheckpointError, match="max_shard_size='5 parsecs'"):
        sf.launch(lambda: sf.export(sf.nn.from_torch(model), str(tmp_path),
                                    max_shard_size="5 parsecs"), world_size=2)
    with pytest.raises(sf.CheckpointError, match="metadata must map strings to strings"):
        sf.launch(lambda: sf.export(sf.nn.from_torch(model), str(tmp_path),
                                    metadata={"step": 3}), world_size=2)
    with pytest.raises(sf.SbpError, match="give placement="):
        sf.launch(lambda: sf.load_pretrained(model, str(tmp_path)), world_size=1)
    assert os.listdir(tmp_path) == []
