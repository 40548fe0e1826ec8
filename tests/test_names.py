"""Names that mean one thing (issue 13): no two modules of the package and the examples share a
file name, and bytes are ``nbytes`` (a boxing plan's, a chosen signature's), never ``cost``
(``sf.cost`` is seconds)."""

from collections import defaultdict
from pathlib import Path

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
