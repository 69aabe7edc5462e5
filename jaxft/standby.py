"""A standby worker: an interpreter started ahead, its imports done, that becomes the next restart.

A restarted worker used to spend its first second or more importing jax, numpy, optax and
jaxft before it could connect (docs/benchmarks.md), while the members trained without it.
``jaxft launch`` keeps one standby per node (:class:`jaxft.supervisor.standby.Standby`):
``<the workers' python> -m jaxft.standby``, with the workers' common environment, imports the
worker side (:data:`PRELOAD`), says it is ready (a file) and waits. When a worker dies, the launcher writes one line
to the standby's stdin (:func:`order`: the new life's environment and nice value), and the
standby becomes that life: it takes the environment, points its stdin at ``/dev/null`` as a
worker's is, and runs the worker's own module or script as ``__main__`` (``runpy``), its
imports found loaded. The pid the launcher watches is the standby's.

Only a command that this interpreter can run the same way is served (:func:`target_of`):
``python [-u] -m module args...`` or ``python [-u] script.py args...``. Anything else (a shell
wrapper, other interpreter options) is started as before. Nothing runs before the order but
imports: no backend, no connection; environment variables that differ per life (the process
id, its incarnation, ...) are read after it.

Both sides of the contract live here (as :mod:`jaxft.priority`'s do); the launcher's side
imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence

from jaxft import priority

LIFE_STARTED = "JAXFT_LIFE_STARTED"  # set by a standby as it becomes a life: when (epoch seconds)

# What a standby imports while it waits: what every worker imports (jax is most of the time),
# and the worker side of jaxft. A missing one is skipped.
PRELOAD = ("numpy", "jax", "jax.numpy", "optax", "absl.app", "absl.flags", "absl.logging",
           "jaxft.worker.runtime", "jaxft.worker.loop", "jaxft.worker.trainer")

_SAFE_OPTIONS = ("-u",)  # interpreter options a standby can honour (unbuffered: set anyway)


@dataclasses.dataclass(frozen=True)
class Target:
    """What a worker command runs: ``module`` (``-m``) or ``script``, with ``args``."""

    interpreter: str
    module: str | None
    script: str | None
    args: tuple[str, ...]


def target_of(command: Sequence[str]) -> Target | None:
    """The Python module or script ``command`` runs, or None when a standby cannot run it."""
    if not command or not os.path.basename(command[0]).startswith("python"):
        return None
    rest = list(command[1:])
    while rest and rest[0] in _SAFE_OPTIONS:
        rest.pop(0)
    if len(rest) >= 2 and rest[0] == "-m":
        return Target(command[0], rest[1], None, tuple(rest[2:]))
    if rest and not rest[0].startswith("-"):
        return Target(command[0], None, rest[0], tuple(rest[1:]))
    return None


def order(env: Mapping[str, str], nice: int | None) -> bytes:
    """The launcher's one line to a standby: become the life with environment ``env`` (all of
    it) at nice value ``nice`` (None: leave the priority as it is)."""
    return (json.dumps({"env": dict(env), "nice": nice}) + "\n").encode()


def _preload() -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _become(target: Target, env: Mapping[str, str], nice: int | None) -> None:
    """Take the life's environment, stdin and priority, then run ``target`` as ``__main__``."""
    import runpy

    os.environ.clear()
    os.environ.update(env)
    os.environ[LIFE_STARTED] = f"{time.time():.6f}"
    if nice is not None:
        priority.set_all_threads(nice)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0, kept open for the life
    if target.module is not None:
        sys.argv = [target.module, *target.args]  # (runpy sets argv[0] to the module's file)
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    else:
        assert target.script is not None
        sys.argv = [target.script, *target.args]
        sys.path[0] = os.path.dirname(os.path.abspath(target.script))
        runpy.run_path(target.script, run_name="__main__")


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m jaxft.standby --ready FILE -- <worker command>``: import, create ``FILE``
    (the launcher hands a restart only to a standby that is ready), wait for the order, become
    the life."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["--ready"] or len(argv) < 3 or argv[2] != "--":
        raise SystemExit("usage: python -m jaxft.standby --ready FILE -- <worker command>")
    ready, argv = argv[1], argv[3:]
    target = target_of([sys.executable, *argv])
    if target is None:
        raise SystemExit(f"jaxft.standby: cannot run {argv!r} in this interpreter")
    _preload()
    with open(ready, "w"):
        pass
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return  # the launcher closed it: no life to take
    msg = json.loads(line)
    _become(target, msg["env"], msg.get("nice"))


if __name__ == "__main__":
    main()
