"""`sbpflow.utils.generated_function`: a function compiled from generated source runs in its
namespace, its traceback shows the generated line, and its source leaves `linecache` once
the function is gone (a plan rebuilt often must not keep every program's source)."""

import gc
import linecache
import traceback

import pytest

from sbpflow.utils import generated_function


def _entries() -> list:
    return [k for k in linecache.cache if str(k).startswith("<sbpflow probe ")]


def test_runs_shows_its_lines_and_leaves_no_source_behind():
    src = "def run(x):\n    return K * x\n\ndef fail():\n    raise ValueError('from the probe')\n"
    ns = {"K": 3}
    run = generated_function(src, "probe", ns)
    assert run(2) == 6 and run.source == src
    with pytest.raises(ValueError) as info:
        generated_function(src, "probe", dict(ns), fn="fail")()
    assert "raise ValueError('from the probe')" in "".join(traceback.format_tb(info.tb))
    del info
    assert len(_entries()) >= 1
    del run, ns
    gc.collect()
    assert _entries() == []
