"""Compiled step programs that outlive a CPU backend rebuild, shared by a run's processes.

On CPU every rejoin rebuilds the backend (:mod:`jaxft.worker.dataplane`), and a rebuild empties jax's
in-memory caches: each member would trace and lower its step again before the persistent cache could serve
the executable, and survivors retrying on a smaller mesh would pay the same to reach an executable process
0 compiled ahead (:mod:`jaxft.worker.warmup`) (measured: docs/benchmarks.md, 'Figures behind the code').

:class:`Executables` compiles each step program ahead of time (``lower(...).compile()``,
what ``jax.jit`` does on a first call) and keeps it twice: loaded, for the current backend,
and serialized (``jax.experimental.serialize_executable``), keyed by the mesh's device ids
and the arguments' shapes and dtypes. After a rebuild the bytes load into the new backend
without tracing. With a directory, process 0's programs are also written there, and another
process with the same *fingerprint* (a hash of a reference program every process lowers
alike, the step on every process's devices: not a process's own first program, a joiner's is
for the mesh it joins) loads them instead of tracing.

A program is compiled once per mesh *width* (and argument signature), not once per device
set: on CPU, the step for devices (0, 2, 3) lowers to the same module as for (1, 2, 3) (the
mesh names devices by position), so a program kept for one loads for the other with its
device assignment replaced (:func:`jaxft._compat.load_compiled`), after checking that the
two lower alike (the hash of the lowered module). A thread that needs a program while another
thread of this process compiles one of the same width and signature waits for that compile
instead of compiling beside it (the warm-up compiles one program per width, and a retry that
needs a width the warm-up is compiling takes its program).

Loading is an optimisation only: any failure to serialize, write, read or load is logged and the program is
compiled as before. Only the run's own directory (or the one the user shares across runs) is read: a serialized
executable can run arbitrary code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jaxft import _compat
from jaxft.worker import compile_marks
from jaxft.worker.arrays import structure_text

logger = logging.getLogger(__name__)

Key = tuple  # (mesh device ids, argument signature)


def mesh_ids(mesh: Any) -> tuple[int, ...]:
    """The ids of ``mesh``'s devices, in mesh order: what names a mesh in every table here."""
    return tuple(d.id for d in mesh.devices.flat)


def signature(args: Sequence[Any]) -> tuple:
    """The arguments' tree structure and per-leaf ``(shape, dtype)``: what a compiled program
    checks its arguments against (shardings follow from the mesh and the layout)."""
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    return (str(treedef),) + tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def key(mesh_ids: tuple[int, ...], args: Sequence[Any]) -> Key:
    """The program ``args`` need on the mesh of ``mesh_ids`` (see :class:`Executables`)."""
    return (tuple(mesh_ids), signature(args))


@dataclasses.dataclass(frozen=True)
class Program:
    """A kept step program: ``blob`` (:func:`jaxft._compat.serialize_compiled`'s bytes),
    ``compiled_for`` (the device ids the bytes were compiled for: a program loaded for
    other devices keeps its source's) and ``module`` (hash of its lowered module; None if
    unknown)."""

    blob: tuple
    compiled_for: tuple[int, ...]
    module: str | None


def module_hash(lowered: Any) -> str:
    """What two programs must share to run one's executable for the other's devices."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()[:32]


def _same_shape(a: Key, b: Key) -> bool:
    """Programs for as many devices with the same argument signature."""
    return len(a[0]) == len(b[0]) and a[1] == b[1]


class Executables:
    """One process's step programs, by mesh and argument signature.

    ``directory``: where the run's processes share the programs they compile (None: this
    process only). A program nobody has yet is compiled by one process (the caller says which:
    ``compiler``), the others wait for its file rather than compiling the same program at the
    same time on the same cores; without a sign of that compile within ``appear_s`` (another
    host with its own directory, a compiler that is not coming), or once ``wait_s`` passed,
    they compile it themselves.
    """

    def __init__(self, directory: str | None = None, appear_s: float = 0.5, wait_s: float = 60.0,
                 reference: Callable[[], str] | None = None) -> None:
        self.directory = directory
        self.reference = reference  # the text the fingerprint hashes (None: this process's first program)
        self.appear_s = appear_s
        self.wait_s = wait_s
        self._lock = threading.Lock()  # the warm-up thread adds programs too
        self._loaded: dict[Key, Any] = {}  # for the current backend
        self._last: dict[tuple[int, ...], Any] = {}  # the program the last call on each mesh ran
        self._blobs: dict[Key, Program] = {}  # serialized
        self._busy: dict[Key, threading.Event] = {}  # being made by a thread of this process
        self._compiling: dict[Key, threading.Event] = {}  # being compiled by XLA (never waiting)
        self.reassign: bool | None = None  # load a same-width program for other devices (CPU; None: not known yet)
        self._fingerprint: str | None = None
        self._pickles: dict[tuple, bool] = {}  # argument signature -> whether its tree structure pickles
        self.loads = 0  # programs loaded from bytes (this process's or shared) instead of compiled
        self.compiles = 0
        self.reassigned = 0  # of the loads: programs compiled for other devices of the same width
        self.preloaded = 0  # programs loaded ahead, before a step needed them (:meth:`preload`)
        self._generation = 0  # bumped by reset(): a load begun for an older backend is dropped

    def reset(self) -> None:
        """The backend was rebuilt: loaded programs belong to the old one; the bytes stay."""
        with self._lock:
            self._loaded.clear()
            self._last.clear()
            self._generation += 1

    def call(self, mesh_ids: tuple[int, ...], fn: Callable, args: Sequence[Any], compiler: bool = True) -> Any:
        """Run ``fn(*args)`` (``fn`` jitted) through its compiled program for this mesh.

        The program the last call on this mesh ran is tried first: a compiled program checks
        its arguments' tree, shapes and dtypes before it runs (``TypeError``), so the signature
        (Python work per leaf) is computed only when they changed (measured: docs/benchmarks.md,
        'Figures behind the code')."""
        exe = self._last.get(mesh_ids)
        if exe is not None:
            try:
                return exe(*args)
            except TypeError:  # other arguments than the last call's: find their program
                pass
        k = key(mesh_ids, args)
        exe = self._loaded.get(k)
        if exe is None:
            exe = self.get(k, fn, args, compiler)
        self._last[mesh_ids] = exe
        return exe(*args)

    def get(self, key: Key, fn: Callable, args: Sequence[Any], compiler: bool = True) -> Any:
        """The loaded program for ``key``: from memory, from bytes (this process's or shared), or
        compiled now. The lock guards the tables only; a thread wanting a program another thread
        of this process is compiling waits for that compile."""
        self.name_shared()
        while True:
            exe = self._loaded.get(key)
            if exe is not None:
                return exe
            with self._lock:
                exe = self._load(key)
                if exe is not None:
                    self._loaded[key] = exe
                    return exe
                busy = self._busy.get(key)
                if busy is None:
                    self._busy[key] = threading.Event()
                    break
            busy.wait()  # then look again: loaded, or that compile failed and this thread tries
        try:
            if not compiler and self._can_share(key, args):
                exe = self._await_shared(key)
            if exe is None:
                exe = self._compile(key, fn, args)
            with self._lock:
                exe = self._loaded.setdefault(key, exe)
        finally:
            with self._lock:
                self._busy.pop(key).set()
        return exe

    def preload(self, key: Key, stale: Callable[[], bool], poll_s: float = 0.2) -> bool:
        """Load ``key``'s program before a step needs it (kept bytes or the shared directory),
        waiting for another process's compile until ``stale()``; never compiles. Whether it
        is loaded (:mod:`jaxft.worker.warmup`: a spare, a member, ahead of a swap)."""
        self.name_shared()
        generation = self._generation
        while self._sharing and not stale():
            with self._lock:
                if key in self._loaded:
                    return True
                if generation != self._generation:  # (the backend was rebuilt meanwhile)
                    return False
                exe = self._load(key)
                if exe is not None:
                    self._loaded[key] = exe
                    self.preloaded += 1
                    return True
            time.sleep(poll_s)
        return False

    def _compile(self, key: Key, fn: Any, args: Sequence[Any]) -> Any:
        """Compile ``key``'s program and keep its bytes, unless jax loaded it from its persistent
        cache (serialized again, such a CPU program loses its kernels, see
        :func:`jaxft._compat.compile_fresh`)."""
        marker = self._mark(key, args)  # first, so that the others wait for this compile from its start
        try:
            lowered = fn.lower(*args)
            if self._fingerprint is None and self.directory is not None:  # now it can read shared ones
                self.name_shared(lowered)
                with self._lock:
                    exe = self._load(key)
                if exe is not None:
                    return exe  # its bytes are kept already
                marker = self._mark(key, args)
            if self.reassign is None:
                self.reassign = jax.devices()[0].platform == "cpu"
            module = module_hash(lowered) if self.reassign else None
            done = threading.Event()
            exe = self._reassigned(key, module, claim=done)
            if exe is not None:
                return exe
            try:  # _reassigned registered this compile (done) as it found nothing to load
                exe, fresh = _compat.compile_fresh(lowered)
                self.compiles += 1
                if fresh:
                    with self._lock:
                        self._keep(key, exe, module)  # the file first, then the marker goes
            finally:
                with self._lock:
                    self._compiling.pop(key, None)
                done.set()
            return exe
        finally:
            if marker is not None:
                with contextlib.suppress(OSError):
                    os.unlink(marker)

    def _reassigned(self, key: Key, module: str | None, claim: threading.Event) -> Any:
        """``key``'s program from a kept program of the same width that lowers to the same
        ``module`` for other devices, loaded for ``key``'s devices. While another thread of
        this process compiles one of the same width and signature, wait for it rather than
        compile beside it. None: there is none; then ``claim`` is registered as this thread's
        compile of ``key`` (in the same lock hold as the look, so that two threads never both
        compile one width; a thread waits only for a compile, which itself never waits)."""
        give_up = time.monotonic() + self.wait_s
        while True:
            with self._lock:
                source = None if module is None else next(
                    (p for k, p in self._blobs.items() if len(k[0]) == len(key[0]) and p.module == module), None)
                pending = [] if module is None else [e for k, e in self._compiling.items() if _same_shape(k, key)]
                if source is None and (not pending or time.monotonic() > give_up):
                    self._compiling[key] = claim
                    return None
            if source is not None:
                break
            pending[0].wait(max(0.0, give_up - time.monotonic()))
        with self._lock:
            program = Program(source.blob, source.compiled_for, module)
            exe = self._load(key, program)
            if exe is None:  # (logged) compile it after all
                self._compiling[key] = claim
                return None
            self.reassigned += 1  # _load kept it under key; the directory gets it for the other processes
            if self._sharing:
                self._write(key, program)
            self._loaded[key] = exe
        return exe

    def name_shared(self, lowered: Any = None) -> None:
        """Name this process's shared programs, once (the first :meth:`get`, or a hot spare ahead):
        the hash of ``reference()`` (or, that failing, of ``lowered``, its first program)."""
        if self._fingerprint is not None or self.directory is None:
            return
        text = None
        if self.reference is not None:
            try:
                text = self.reference()
            except Exception as e:  # noqa: BLE001 - fall back to this process's own first program
                logger.debug("no reference program for the shared step programs: %s", e)
        if text is None and lowered is not None:
            text = lowered.as_text()
        if text is not None:
            self._fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]

    def _mark(self, key: Key, args: Sequence[Any]) -> str | None:
        """Say in the directory that this process compiles ``key`` (None: not sharing)."""
        return compile_marks.claim(self._path(key)) if self._sharing and self._can_share(key, args) else None

    def _can_share(self, key: Key, args: Sequence[Any]) -> bool:
        """Whether ``args``' tree structure pickles, as a program's bytes carry it: a flax
        ``TrainState``'s functions (closures) do not, and then nobody waits for a file that
        cannot be written."""
        ok = self._pickles.get(key[1])
        if ok is None:
            try:
                pickle.dumps(jax.tree_util.tree_structure(tuple(args)))
                ok = True
            except Exception:  # noqa: BLE001 - pickling fails in many ways (a local function, a lock)
                ok = False
            self._pickles[key[1]] = ok
        return ok

    @property
    def _sharing(self) -> bool:
        return self.directory is not None and self._fingerprint is not None

    def _await_shared(self, key: Key) -> Any:
        """Wait for another process's compile of ``key`` to land in the directory
        (:func:`jaxft.worker.compile_marks.wait_for`), and load it; None if it does not."""
        if not self._sharing or not compile_marks.wait_for(self._path(key), self.appear_s, self.wait_s):
            return None
        with self._lock:
            return self._load(key)

    # -- bytes ----------------------------------------------------------------------------
    def _keep(self, key: Key, compiled: Any, module: str | None = None) -> None:
        if key in self._blobs:
            return
        try:
            blob = _compat.serialize_compiled(compiled)
        except Exception as e:  # noqa: BLE001 - e.g. a program with constants: compile after rebuilds
            logger.debug("step program for %s not serializable: %s", key[0], e)
            return
        self._keep_program(key, Program(blob, tuple(key[0]), module))

    def _keep_program(self, key: Key, program: Program) -> None:
        if key in self._blobs:
            return
        self._blobs[key] = program
        if self._sharing:
            self._write(key, program)

    def _load(self, key: Key, program: Program | None = None) -> Any:
        """``key``'s program loaded from bytes: ``program``'s, else its own kept or shared ones."""
        if program is None:
            program = self._blobs.get(key)
        if program is None and self._sharing:
            program = self._read(key)
        if program is None:
            return None
        try:
            by_id = {d.id: d for d in jax.devices()}
            exe = _compat.load_compiled(program.blob, [by_id[i] for i in key[0]], program.compiled_for)
        except Exception as e:  # noqa: BLE001 - compile instead
            logger.warning("could not load the step program for devices %s (%s); compiling it", key[0], e)
            self._blobs.pop(key, None)
            return None
        self._blobs.setdefault(key, program)
        self.loads += 1
        return exe

    @property
    def _shared(self) -> str:
        assert self.directory is not None  # (only while sharing)
        return self.directory

    def _path(self, key: Key) -> str:
        name = hashlib.sha256(_shared_name(key).encode()).hexdigest()[:24]
        return os.path.join(self._shared, f"step-{self._fingerprint}-{name}.pkl")

    def _write(self, key: Key, program: Program) -> None:
        path = self._path(key)
        if os.path.exists(path):
            return
        try:
            os.makedirs(self._shared, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._shared, prefix=".tmp-")
            with os.fdopen(fd, "wb") as f:
                pickle.dump((_shared_name(key), program), f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)  # readers never see half a file
        except Exception as e:  # noqa: BLE001 - e.g. a tree node that does not pickle
            logger.debug("could not share the step program for %s: %s", key[0], e)
            with contextlib.suppress(OSError, NameError):  # (NameError: mkstemp itself failed)
                os.unlink(tmp)

    def _read(self, key: Key) -> Program | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                stored_key, program = pickle.load(f)
        except FileNotFoundError:
            return None
        except Exception as e:  # noqa: BLE001 - a damaged file: compile instead
            logger.warning("unreadable shared step program %s (%s); compiling it", path, e)
            return None
        return program if stored_key == _shared_name(key) and isinstance(program, Program) else None


def _shared_name(key: Key) -> str:
    """``key`` as the processes sharing programs name it: without object addresses (the
    arguments' static data, such as a flax ``TrainState``'s functions, print them, and they
    differ from process to process; the reference program's fingerprint in the file's name
    tells programs of different code apart)."""
    return structure_text(repr(key))
