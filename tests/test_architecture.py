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
    bad = {p.name: sorted(m for m in _imports(p) if m.startswith(("jaxft.worker", "jaxft.supervisor")))
           for p in shared}
    assert not {k: v for k, v in bad.items() if v}, bad
