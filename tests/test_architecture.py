"""The layout the code keeps: two programs in two packages that share only the contract.

* the supervisor (``jaxft.supervisor``: ``jaxft launch``, its console, restart policy, crash
  loop, report) imports no jax and none of the worker's code, at import or when its modules
  load, so a launcher never pays jax's import and never depends on the training code;
* the worker (``jaxft.worker``) never imports the supervisor;
* what both use lives beside them at the top of the package (``jaxft.protocol``: environment,
  state-dir files, exit codes, event names; errors, timeouts, faults, events, net).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from helpers import PYTHON, REPO, run

PACKAGE = REPO / "jaxft"
pytestmark = pytest.mark.smoke


def _modules(sub: str) -> list[str]:
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                  for p in (PACKAGE / sub).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at any depth of its code)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def test_the_supervisor_imports_no_jax_and_no_worker_code():
    code = f"""
import importlib, json, sys
for m in {_modules("supervisor") + ["jaxft.cli", "jaxft"]!r}:
    importlib.import_module(m)
print(json.dumps(sorted(m for m in sys.modules if m == "jax" or m.startswith(("jax.", "jaxlib", "jaxft.worker")))))
"""
    r = run([PYTHON, "-c", code], timeout=60)
    assert r.returncode == 0, r.describe()
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [], r.stdout


@pytest.mark.parametrize("side,other", [("supervisor", "jaxft.worker"), ("worker", "jaxft.supervisor")])
def test_one_side_never_imports_the_other(side, other):
    bad = {str(p.relative_to(REPO)): sorted(m for m in _imports(p) if m == other or m.startswith(other + "."))
           for p in (PACKAGE / side).rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_shared_modules_import_neither_side():
    shared = [p for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "cli.py")]
    shared += [*(PACKAGE / "_compat").rglob("*.py"), *(PACKAGE / "core").rglob("*.py")]
    bad = {str(p.relative_to(PACKAGE)): sorted(m for m in _imports(p)
                                               if m.startswith(("jaxft.worker", "jaxft.supervisor")))
           for p in shared}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_protocol_core_does_no_io():
    """jaxft.core decides; it imports nothing but pure standard-library parts, numpy and itself
    (no jax, no sockets, threads, clocks or files), so a simulation can drive it."""
    allowed = ("__future__", "dataclasses", "enum", "collections", "typing", "itertools", "functools",
               "math", "statistics", "numpy", "jaxft.core")  # (numpy: the vote rows are arrays)
    bad = {str(p.relative_to(PACKAGE)): sorted(m for m in _imports(p) if not m.startswith(allowed))
           for p in (PACKAGE / "core").rglob("*.py")}
    assert not {k: v for k, v in bad.items() if v}, bad


# -- sizes --------------------------------------------------------------------------------------
MAX_MODULE_LINES, MAX_CLASS_LINES, MAX_PARAMS = 400, 300, 8
# The one exception, on purpose: every bound jaxft waits under, one flat settings object whose
# field names are what `--timeout NAME=S` and each give-up message name.
WIDE_ON_PURPOSE = {"jaxft/timeouts.py:Timeouts"}


def _is_dataclass(node: ast.ClassDef) -> bool:
    def name(d: ast.expr) -> str:
        d = d.func if isinstance(d, ast.Call) else d
        return d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")

    return any(name(d) == "dataclass" for d in node.decorator_list)


def _no_init(call: ast.Call) -> bool:
    return any(k.arg == "init" and getattr(k.value, "value", True) is False for k in call.keywords)


def _init_fields(node: ast.ClassDef, helpers: set[str]) -> list[str]:
    """A dataclass's constructor parameters: its annotated fields, bar ``field(init=False)``
    (directly, or through one of the module's ``helpers`` that returns such a field)."""
    out = []
    for s in node.body:
        if not isinstance(s, ast.AnnAssign) or not isinstance(s.target, ast.Name):
            continue
        call = s.value if isinstance(s.value, ast.Call) else None
        if call is not None and (_no_init(call) or getattr(call.func, "id", None) in helpers):
            continue
        if "ClassVar" in ast.unparse(s.annotation):
            continue
        out.append(s.target.id)
    return out


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return names + ([a.vararg.arg] if a.vararg else []) + ([a.kwarg.arg] if a.kwarg else [])


def _size_violations(path: Path) -> list[str]:
    rel = str(path.relative_to(REPO))
    text = path.read_text()
    out = [f"{rel}: {len(text.splitlines())} lines"] if len(text.splitlines()) > MAX_MODULE_LINES else []
    tree = ast.parse(text)
    helpers = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)
               and any(isinstance(c, ast.Call) and _no_init(c) for c in ast.walk(n))}
    public_defs = [(n, None) for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        where = f"{rel}:{cls.name}"
        if cls.end_lineno - cls.lineno + 1 > MAX_CLASS_LINES:
            out.append(f"class {where}: {cls.end_lineno - cls.lineno + 1} lines")
        if cls.name.startswith("_") or where in WIDE_ON_PURPOSE:
            continue
        if _is_dataclass(cls) and len(_init_fields(cls, helpers)) > MAX_PARAMS:
            out.append(f"{where}: {len(_init_fields(cls, helpers))} constructor fields")
        public_defs += [(n, cls.name) for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn, owner in public_defs:
        if fn.name.startswith("_") and fn.name != "__init__":
            continue
        if len(_params(fn)) > MAX_PARAMS:
            out.append(f"{rel}:{owner + '.' if owner else ''}{fn.name}: {len(_params(fn))} parameters")
    return out


def test_modules_classes_and_signatures_stay_small():
    """No module over 400 lines, no class over 300, no public function or constructor with
    more than 8 parameters (a dataclass's fields are its constructor's): options objects
    instead of long keyword lists, one idea per module."""
    bad = [v for p in sorted(PACKAGE.rglob("*.py")) for v in _size_violations(p)]
    assert not bad, "\n".join(bad)


def test_the_size_check_sees_what_it_checks(tmp_path):
    # a check that cannot fail is no check: each rule trips on a file made to break it
    wide = "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"
    fields = ("import dataclasses\n@dataclasses.dataclass\nclass C:\n"
              + "".join(f"    x{i}: int = 0\n" for i in range(9)))
    long_class = "class D:\n" + "    x = 1\n" * 300
    for text, needle in ((wide, "9 parameters"), (fields, "9 constructor fields"), (long_class, "301 lines")):
        path = REPO / "jaxft" / "_size_probe.py"
        try:
            path.write_text(text)
            assert any(needle in v for v in _size_violations(path)), (needle, _size_violations(path))
        finally:
            path.unlink()
