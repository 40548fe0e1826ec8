"""Names that mean one thing (issues 13, 37): no two modules of the package and the examples share
a file name, no two public classes of the package share a name, and bytes are ``nbytes`` (a boxing
plan's, a chosen signature's), never ``cost`` (``sf.cost`` is seconds). A renamed public name
keeps working for one release, with a DeprecationWarning."""

import ast
import importlib
import warnings
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import sbpflow as sf

ROOT = Path(__file__).resolve().parents[1]


def test_no_two_modules_share_a_name():
    seen = defaultdict(list)
    for top in ("sbpflow", "examples"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name not in ("__init__.py", "__main__.py"):
                seen[path.name].append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


def test_no_two_public_classes_share_a_name():
    seen = defaultdict(list)
    for path in sorted((ROOT / "sbpflow").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                seen[node.name].append(str(path.relative_to(ROOT)))
    assert len(seen) > 100
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}


RENAMED = [  # (module, old name, what it is now): the deprecated aliases kept for one release
    ("sbpflow", "SignatureError", "sbpflow.errors.SignatureError"),
    ("sbpflow", "SearchCliError", "sbpflow.errors.SearchCliError"),
    ("sbpflow.boxing", "Step", "sbpflow.boxing.BoxingStep"),
    ("sbpflow.models", "Layout", "sbpflow.models.NamedLayout"),
    ("sbpflow.auto", "Graph", "sbpflow.auto.LayerGraph"),
    ("sbpflow.auto", "Pipeline", "sbpflow.auto.PipelineShape"),
    ("sbpflow.auto.space", "Pipeline", "sbpflow.auto.space.PipelineShape"),
    ("sbpflow.auto", "interop", "sbpflow.auto.pipeline_search"),
    ("sbpflow.auto", "graph", "sbpflow.auto.layer_graph"),
    ("sbpflow.nn", "pending_mean", "sbpflow.nn.eager_count_mean"),
    ("sbpflow.utils", "generate_region", "sbpflow.random_regions.generate_region"),
    ("sbpflow.utils", "mix_seed", "sbpflow.random_regions.mix_seed"),
    ("sbpflow.parallel.cdp.cycles", "Op", "sbpflow.parallel.cdp.cycles.StageOp"),
    ("sbpflow.parallel.cdp.program", "Transfer", "sbpflow.parallel.cdp.program.PeerTransfer"),
    *[("sbpflow.nn.modules", name, f"sbpflow.nn.layers.{name}") for name in sf.nn.layers.__all__],
]


def _resolve(dotted: str):
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError:
        home, _, name = dotted.rpartition(".")
        return getattr(importlib.import_module(home), name)


@pytest.mark.parametrize("module,old,new", RENAMED)
def test_a_renamed_name_keeps_working_with_a_warning(module, old, new):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = getattr(importlib.import_module(module), old)
    assert got is _resolve(new)
    if module != "sbpflow":  # the face warns once (tests/test_errors.py)
        assert any(issubclass(w.category, DeprecationWarning) for w in seen), (module, old)
    assert old not in getattr(importlib.import_module(module), "__all__", ())


def test_one_name_each():
    pl = sf.placement("cpu", [0])
    plan = sf.boxing.plan((4, 4), torch.float32, (pl, sf.S(0)), (pl, sf.B))
    assert plan.nbytes == 0 and not hasattr(plan, "cost")
    fields = sf.ops.Choice.__dataclass_fields__   # a chosen signature's bytes of input boxing
    assert "nbytes" in fields and "cost" not in fields
    # the model-graph presets of the search and the runnable models have different names
    assert hasattr(sf.auto, "model_graphs") and not hasattr(sf.auto, "models")
    # sf.auto.trace traces a model; recording the boxing steps run is another name
    assert hasattr(sf.boxing, "record_steps") and not hasattr(sf.boxing, "trace")
