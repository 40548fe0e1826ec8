"""Short units (issue 13): module docstrings say what a module is for in at most 15 lines and
point to docs/ for the rest; no function is over 60 lines unless its docstring says why
("Not split: ..."); every docs pointer ("docs/x.md, 'Section'") names a real section; the
examples moved into docs/ still run."""

import ast
import doctest
import re
from pathlib import Path

import sbpflow as sf

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sbpflow"
MAX_DOC_LINES = 15
MAX_FUNCTION_LINES = 60

# Modules whose shortening other work of issue 13 owns (remove an entry once it is done).
PENDING_DOCS: set = set()


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text())


def test_module_docstrings_are_short():
    long = {}
    for rel, tree in _modules():
        if rel in PENDING_DOCS or ast.get_docstring(tree) is None:
            continue
        node = tree.body[0]
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_DOC_LINES:
            long[rel] = lines
    assert long == {}, f"module docstrings over {MAX_DOC_LINES} lines (move the detail to docs/)"


def test_long_functions_say_why():
    long = {}
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES \
                    and "Not split:" not in (ast.get_docstring(node) or ""):
                long[f"{rel}:{node.name}"] = lines
    assert long == {}, f"functions over {MAX_FUNCTION_LINES} lines without a reason"


def _headings(doc: Path) -> list[str]:
    return [re.sub(r"^#+\s*", "", line).strip()
            for line in doc.read_text().splitlines() if line.startswith("#")]


def test_docs_pointers_name_real_sections():
    pointer = re.compile(r"docs/([\w-]+\.md),\s+'([^']+)'")
    missing, found = [], 0
    for path in sorted(PACKAGE.rglob("*.py")):
        for doc, section in pointer.findall(path.read_text()):
            found += 1
            section = " ".join(section.split())     # a pointer may wrap across lines
            target = ROOT / "docs" / doc
            if not target.exists() or not any(h.startswith(section) for h in _headings(target)):
                missing.append(f"{path.relative_to(ROOT)}: docs/{doc}, '{section}'")
    assert found > 0
    assert missing == []


def test_docs_examples_run():
    parser, ran = doctest.DocTestParser(), 0
    for doc in sorted((ROOT / "docs").glob("*.md")):
        for i, block in enumerate(re.findall(r"```python\n(>>>.*?)```", doc.read_text(), re.S)):
            test = parser.get_doctest(block, {"sf": sf, "Cluster": sf.cost.Cluster},
                                      f"{doc.name}[{i}]", str(doc), 0)
            runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
            runner.run(test)
            assert runner.failures == 0, f"{doc.name}: example {i} fails"
            ran += runner.tries
    assert ran > 0
