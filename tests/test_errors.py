"""Every sbpflow error class is defined in sbpflow/errors.py, is an `sf.SbpError`, and is also
the built-in exception a torch user would catch (ValueError, RuntimeError, IndexError, ...)."""

import ast
import inspect
import pathlib

import sbpflow as sf
from sbpflow import errors

PACKAGE = pathlib.Path(sf.__file__).parent


def test_no_error_class_outside_errors_py():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    "Error" in ast.unparse(b) or "Exception" in ast.unparse(b)
                    for b in node.bases):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    assert not found, "define these in sbpflow/errors.py:\n" + "\n".join(found)


def test_every_error_is_an_sbp_error_and_a_builtin():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass)
               if c.__module__ == errors.__name__]
    assert len(classes) > 20
    for c in classes:
        assert issubclass(c, sf.SbpError), c
        if c is sf.SbpError:
            continue
        builtins_ = [b for b in c.__mro__ if b.__module__ == "builtins" and b not in
                     (Exception, BaseException, object)]
        assert builtins_, f"{c.__name__} is no built-in exception (ValueError, RuntimeError, ...)"
        assert getattr(sf.errors, c.__name__) is c, f"sf.errors.{c.__name__} is not exported"


TOP = {"SbpError", "PlacementError", "ShapeError", "CommError", "CheckpointError", "GraphError"}


def test_the_common_errors_at_the_top_the_rest_under_sf_errors():
    top = {n for n in sf.__all__ if isinstance(getattr(sf, n), type)
           and issubclass(getattr(sf, n), BaseException)}
    assert top == TOP
    assert "SearchCliError" not in sf.__all__ and "SearchCliError" not in vars(sf)


def test_a_moved_error_keeps_its_old_name_for_one_release():
    import warnings
    sf._WARNED.discard("SignatureError")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert sf.SignatureError is sf.errors.SignatureError
        assert sf.SignatureError is sf.errors.SignatureError
    moved = [w for w in seen if issubclass(w.category, DeprecationWarning)]
    assert len(moved) == 1 and "sf.errors.SignatureError" in str(moved[0].message)
