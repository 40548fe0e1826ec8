"""The docs site (issue 39): the strict mkdocs build passes (a broken link, a missing page or
reference, a docstring the handler cannot read fails it), every ```python block of the docs
that a user is meant to run runs (the blocks of a page in order, in one namespace, on the
threads backend; a block preceded by `<!-- docs-test: skip (why) -->` is not run), and the
doctest examples in sbpflow's docstrings pass. Build with `make docs`."""

import doctest
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
import warnings
from contextlib import redirect_stdout
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\b(.*?)-->")
FENCE = re.compile(r"^```(\w*)\s*$")


class Block(NamedTuple):
    """One fenced block of a page: its first line, language, code, and the reason of its skip
    marker (None: not skipped)."""
    line: int
    lang: str
    code: str
    skip: str | None


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of a markdown file, top-level fences only (a fence inside an indented
    list item counts too; nested fences are not used in these docs)."""
    lines, out, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if m and m.group(1):
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            k = i - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            marker = SKIP.search(lines[k]) if k >= 0 else None
            out.append(Block(i + 1, m.group(1), "\n".join(lines[i + 1:j]),
                             marker.group(1).strip(" :()") if marker else None))
            i = j
        i += 1
    return out


PAGES = sorted(p for p in DOCS.rglob("*.md")) + [ROOT / "README.md"]


def _page_id(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def test_every_python_block_runs_or_says_why_not():
    """A skipped block must give its reason, so 'not meant to run' is a decision, not rot."""
    bad = [f"{_page_id(p)}:{b.line}" for p in PAGES for b in blocks(p)
           if b.lang == "python" and b.skip is not None and len(b.skip) < 10]
    assert bad == [], "skip markers need a reason: <!-- docs-test: skip (why) -->"


@pytest.mark.parametrize("page", [p for p in PAGES
                                  if any(b.lang == "python" and b.skip is None for b in blocks(p))],
                         ids=_page_id)
def test_page_examples_run(page, tmp_path, monkeypatch):
    """The page's python blocks, in order, in one namespace, in a scratch working directory
    (blocks that write files write there). A block that starts with `>>>` is a doctest."""
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    doctest_globals = {"sf": importlib.import_module("sbpflow")}  # as tests/test_units.py's
    doctest_globals["Cluster"] = doctest_globals["sf"].cost.Cluster
    for block in blocks(page):
        if block.lang != "python" or block.skip is not None:
            continue
        where = f"{_page_id(page)}:{block.line}"
        if block.code.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(block.code, dict(doctest_globals),
                                                       where, where, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
            runner.run(test, out=lambda s: None)
            assert runner.failures == 0, f"{where}: doctest fails"
            continue
        with redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            exec(compile(block.code, where, "exec"), namespace)


def _modules_with_examples():
    for path in sorted((ROOT / "sbpflow").rglob("*.py")):
        if ">>> " in path.read_text():
            rel = path.relative_to(ROOT).with_suffix("")
            yield ".".join(p for p in rel.parts if p != "__init__")


@pytest.mark.parametrize("module", list(_modules_with_examples()))
def test_docstring_examples_run(module):
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    tried = 0
    for test in finder.find(mod, module, extraglobs={"sf": importlib.import_module("sbpflow")}):
        runner.run(test, out=lambda s: None)
        tried += len(test.examples)
    assert tried > 0 and runner.failures == 0, f"{module}: {runner.failures} docstring examples fail"


def test_strict_build(tmp_path):
    """`mkdocs build --strict` (what `make docs` runs) into a scratch folder."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "sbpflow" / "index.html").exists()


REFERENCE_MODULES = ["sbpflow", "sbpflow.nn", "sbpflow.nn.functional", "sbpflow.nn.init",
                     "sbpflow.optim", "sbpflow.parallel", "sbpflow.auto", "sbpflow.data",
                     "sbpflow.comm", "sbpflow.boxing", "sbpflow.errors", "sbpflow.cost",
                     "sbpflow.memory", "sbpflow.cli"]


def _public(module) -> list[str]:
    return list(getattr(module, "__all__", None)
                or [n for n in vars(module) if not n.startswith("_")])


def _undocumented(obj, name: str) -> list[str]:
    """``name`` if the class or function has no docstring, and its public methods and
    properties that have none (a method overriding a documented one inherits its docstring,
    as `help()` shows it)."""
    missing = [] if (vars(obj).get("__doc__") if inspect.isclass(obj) else obj.__doc__) \
        else [name]
    for attr, value in (vars(obj).items() if inspect.isclass(obj) else ()):
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            doc = value.__doc__
        elif inspect.isfunction(getattr(value, "__func__", value)):
            doc = inspect.getdoc(getattr(obj, attr))
        else:
            continue
        if not (doc or "").strip():
            missing.append(f"{name}.{attr}")
    return missing


def test_public_names_have_docstrings():
    """Every public class and function of the reference's modules, and their public methods
    and properties, has a docstring (the API reference shows only documented members)."""
    missing, seen = [], set()
    for module_name in REFERENCE_MODULES:
        module = importlib.import_module(module_name)
        for name in _public(module):
            obj = getattr(module, name, None)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    or not getattr(obj, "__module__", "").startswith("sbpflow"):
                continue
            key = (obj.__module__, obj.__qualname__)
            if key not in seen:
                seen.add(key)
                missing += _undocumented(obj, f"{module_name}.{name}")
    assert len(seen) > 150
    assert missing == [], f"{len(missing)} public names lack a docstring"
