"""Compiled programs kept on disk across processes, so that a restart neither traces nor lowers
them.

jax's persistent compilation cache (`jax_compilation_cache_dir`) spares a restart XLA's
compiles, but its key is a hash of the lowered module: every start still traces and lowers each
program in Python before it can look it up, and a warm-up's few hundred step programs (page-table
widths times batch shapes times the fan-out and score variants) cost a restart as long as
their lowering. This store keys a program's serialized executable by what the program is built
from instead (as vLLM keys its compile cache by a hash of its configuration and source code):

- the program's description, which its ModelRunner gives (the model's structure, its argument
  shapes and dtypes, the bucket shape and the static arguments), and
- the environment: forkjax's source files, jax and jaxlib versions, the backend and its
  devices, jax's configuration and XLA_FLAGS.

A program found is loaded (deserialized) where it would have been compiled; one not found is
lowered and compiled as before, then written. Only executables XLA compiled in this process are
written: one that jax's cache gave back does not serialize whole again on every backend (XLA:CPU's
lacks its compiled functions, and a process loading it fails when it runs it). So that jax's
cache does not give back a program the store lacks (the same module compiled by an earlier
forkjax), its module is named after its key in the store, which jax's cache key includes.

The store lives beside jax's cache, in `forkjax-programs/` under its directory, and only while
that directory is set. Its size is bounded as jax bounds its cache (`jax_compilation_cache_max_size`
bytes, unbounded by default): a write past it removes the programs least recently used.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
import threading
import time

import jax
from jax.experimental import serialize_executable
from jax.extend.mlir import ir

log = logging.getLogger("forkjax")

STORE_DIR = "forkjax-programs"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"

# Whether the compile running on this thread was a hit of jax's cache (jax reports a hit on the
# thread that compiles).
_compiling = threading.local()


def _note_cache_hit(event: str, **_):
    if event == _CACHE_HIT:
        _compiling.hit = True


jax.monitoring.register_event_listener(_note_cache_hit)


@functools.cache
def _source_digest() -> str:
    """sha256 of forkjax's Python source files (their paths and contents)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def environment(devices) -> str:
    """What every program also depends on: forkjax's source, jax's version and configuration,
    XLA_FLAGS and the devices it runs on (their backend's version included)."""
    backend = devices[0].client
    return repr((_source_digest(), jax.__version__, jax.lib.__version__, backend.platform,
                 backend.platform_version, [(d.id, d.device_kind) for d in devices],
                 len(jax.devices()), os.environ.get("XLA_FLAGS", ""),
                 sorted((k, repr(v)) for k, v in jax.config.values.items())))


class ProgramStore:
    def __init__(self, directory: str, devices, description: str):
        """`devices`: those the programs run on, in their order; `description`: what every
        program of its owner depends on besides its own shape (a stable repr)."""
        self.directory, self.devices = directory, list(devices)
        self._prefix = (environment(self.devices) + description).encode()
        self._lock = threading.Lock()
        self.loaded = self.saved = 0  # programs loaded from the store, written to it
        self.load_s = self.save_s = 0.0  # seconds those took (on the compile threads, summed)

    @classmethod
    def beside_jax_cache(cls, devices, description: str) -> ProgramStore | None:
        """The store under jax's compilation cache directory; None when that is not set."""
        root = jax.config.jax_compilation_cache_dir
        return cls(os.path.join(root, STORE_DIR), devices, description) if root else None

    def lowering(self, program, lower):
        """() -> what compiler.ShapeCompiler compiles (an object with `compile()`): the stored
        executable of `program` (a hashable, stable-repr tuple) if there is one, else `lower()`'s
        jax Lowered, which writes its executable here once compiled."""
        key = hashlib.sha256(self._prefix + repr(program).encode()).hexdigest()
        return lambda: (_Stored(self, key, lower) if os.path.exists(self.path(key))
                        else _Storing(self, key, lower()))

    def path(self, key: str) -> str:
        return os.path.join(self.directory, key + ".bin")

    def __str__(self):
        return (f"program store {self.directory}: {self.loaded} loaded in {self.load_s:.1f} s, "
                f"{self.saved} written in {self.save_s:.1f} s")

    def trim(self) -> None:
        """Remove the least recently used programs while the store is over
        `jax_compilation_cache_max_size` bytes (no bound when that is not positive)."""
        limit = jax.config.jax_compilation_cache_max_size
        if limit <= 0:
            return
        with self._lock:
            entries = []
            for entry in os.scandir(self.directory):
                if entry.name.endswith(".bin"):
                    try:
                        st = entry.stat()
                    except OSError:  # removed meanwhile by another process
                        continue
                    entries.append((st.st_mtime, st.st_size, entry.path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= limit:
                    break
                try:
                    os.remove(path)
                except OSError:
                    pass
                total -= size

    def _loaded(self, seconds: float):
        with self._lock:
            self.loaded += 1
            self.load_s += seconds

    def _saved(self, seconds: float):
        with self._lock:
            self.saved += 1
            self.save_s += seconds


class _Stored:
    """A program in the store: compiling it loads it (or, where it cannot be read, removes it
    and lowers and compiles the program again)."""

    def __init__(self, store: ProgramStore, key: str, lower):
        self.store, self.key, self.lower = store, key, lower

    def compile(self):
        path, t = self.store.path(self.key), time.perf_counter()
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(
                blob, in_tree, out_tree, execution_devices=self.store.devices)
        except Exception as e:  # cut short, or not jax's pickle: compile it again
            log.warning("program store: %s unreadable (%s); compiling it again", os.path.basename(path),
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            try:
                os.remove(path)
            except OSError:
                pass
            return _Storing(self.store, self.key, self.lower()).compile()
        self.store._loaded(time.perf_counter() - t)
        os.utime(path)  # recently used: the last to go when the store is over its size
        return compiled


class _Storing:
    """A lowered program not in the store: compiling it writes its executable there."""

    def __init__(self, store: ProgramStore, key: str, lowered):
        self.store, self.key, self.lowered = store, key, lowered
        module = lowered.compiler_ir()  # the very module compile() compiles: renamed (docstring)
        with module.context:
            name = ir.StringAttr(module.operation.attributes["sym_name"]).value
            module.operation.attributes["sym_name"] = ir.StringAttr.get(f"{name}_{key[:16]}")

    def compile(self):
        _compiling.hit = False
        compiled = self.lowered.compile()
        if _compiling.hit:  # from jax's cache: it would not serialize whole (module docstring)
            return compiled
        path, t = self.store.path(self.key), time.perf_counter()
        try:
            blob = pickle.dumps(serialize_executable.serialize(compiled))
            os.makedirs(self.store.directory, exist_ok=True)
            # written whole or not at all: another process may be reading the store
            fd, tmp = tempfile.mkstemp(dir=self.store.directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(blob)
                os.replace(tmp, path)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
        except Exception as e:  # an executable that does not serialize is compiled each start
            log.warning("program store: not writing %s (%s)", os.path.basename(path), e)
        else:
            self.store.trim()
            self.store._saved(time.perf_counter() - t)
        return compiled
