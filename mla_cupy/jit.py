"""JIT loader: ``kernels/*.cu`` sources -> CuPy ``RawModule`` objects, compiled on first use.

The ``.cu``/``.cuh`` texts are read when the package is imported (no compilation, no GPU needed).
A module is compiled the first time a kernel of one (file, template-argument set) family is
requested, with every name expression of that family in one NVRTC call, and kept:

* in-process, keyed by (file, name expressions, architecture); a per-key lock makes two threads
  that ask for the same kernel at once compile it once;
* on disk, through CuPy's kernel cache (``CUPY_CACHE_DIR``). Local ``#include "x.cuh"`` lines
  are inlined before compiling, so the cache key covers the headers too.

On Hopper (compute capability 9.0) the target is ``sm_90a`` so that ``wgmma``/``setmaxnreg`` are
available; elsewhere it is the device's own ``sm_XY``.
"""
from __future__ import annotations

import posixpath
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

__all__ = [
    "KERNEL_DIR",
    "KernelCompileError",
    "kernel_source",
    "get_function",
    "get_global",
    "compile_offline",
    "arch_for_capability",
    "compiled_modules",
    "compile_count",
]


def _find_kernel_dir() -> Path:
    here = Path(__file__).resolve().parent
    for cand in (here / "kernels", here.parent / "kernels"):  # installed wheel, then checkout
        if (cand / "common.cuh").is_file():
            return cand
    raise ImportError(f"mla_cupy: kernel sources not found next to {here}")


KERNEL_DIR: Path = _find_kernel_dir()

# Read once at import: path under kernels/ (e.g. "sm90/config.cuh") -> text.
_RAW_SOURCES: Dict[str, str] = {
    p.relative_to(KERNEL_DIR).as_posix(): p.read_text(encoding="utf-8")
    for p in sorted(KERNEL_DIR.rglob("*")) if p.suffix in (".cu", ".cuh")
}

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


def kernel_source(filename: str) -> str:
    """Return the full text of ``kernels/<filename>`` with local includes inlined (once each).

    A local ``#include "x"`` is resolved against the including file's folder, as a C++ compiler
    does (``"../common.cuh"`` from ``sm90/config.cuh`` is ``common.cuh``)."""
    seen: set = set()

    def expand(name: str) -> str:
        if name not in _RAW_SOURCES:
            raise FileNotFoundError(f"mla_cupy kernel source {name!r} not found in {KERNEL_DIR}")
        if name in seen:
            return ""
        seen.add(name)
        text = _RAW_SOURCES[name].replace("#pragma once", "")
        folder = posixpath.dirname(name)
        return _INCLUDE_RE.sub(lambda m: expand(posixpath.normpath(posixpath.join(folder, m.group(1)))), text)

    return f"// ---- {filename} (local includes inlined) ----\n" + expand(filename)


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel instantiation; the message names it and carries the log."""


def arch_for_capability(cc: str) -> str:
    """``'90'`` -> ``'sm_90a'`` (Hopper's arch-specific features), ``'80'`` -> ``'sm_80'``."""
    return f"sm_{cc}a" if cc == "90" else f"sm_{cc}"


def _options(arch: str) -> Tuple[str, ...]:
    return ("-std=c++17", f"-arch={arch}")


@dataclass(frozen=True)
class _Key:
    filename: str
    name_expressions: Tuple[str, ...]
    arch: str


_modules: Dict[_Key, object] = {}
_functions: Dict[Tuple[_Key, str], object] = {}
_globals: Dict[tuple, object] = {}
_locks: Dict[_Key, threading.Lock] = {}
_registry_lock = threading.Lock()
_compiles = 0


def _device_arch() -> str:
    import cupy

    return arch_for_capability(cupy.cuda.Device().compute_capability)


def _module(filename: str, name_expressions: Sequence[str], name: str, arch: Optional[str]):
    """(key, RawModule) of the family, compiled on first use; ``name`` must be one of its expressions."""
    global _compiles
    import cupy

    arch = arch or _device_arch()
    key = _Key(filename, tuple(name_expressions), arch)
    if name not in key.name_expressions:
        raise ValueError(f"{name!r} is not among the name expressions of this module")
    with _registry_lock:
        module = _modules.get(key)
        lock = _locks.setdefault(key, threading.Lock())
    if module is None:
        with lock:
            module = _modules.get(key)
            if module is None:
                try:
                    module = cupy.RawModule(
                        code=kernel_source(filename),
                        options=_options(arch),
                        name_expressions=list(key.name_expressions),
                    )
                    module.compile()
                except cupy.cuda.compiler.CompileException as exc:
                    raise KernelCompileError(
                        f"compiling {filename} for {arch} failed; instantiations {list(key.name_expressions)}:\n{exc}"
                    ) from exc
                with _registry_lock:
                    _modules[key] = module
                    _compiles += 1
    return key, module


def get_function(filename: str, name_expressions: Sequence[str], name: str, arch: Optional[str] = None):
    """Return the ``cupy.RawKernel`` for instantiation ``name`` of ``kernels/<filename>``.

    ``name_expressions`` is the whole family compiled together (``name`` must be one of them).
    """
    fn = _functions.get((_Key(filename, tuple(name_expressions), arch or _device_arch()), name))
    if fn is not None:  # hot path: no lock, no driver call
        return fn
    key, module = _module(filename, name_expressions, name, arch)
    fn = module.get_function(name)
    with _registry_lock:
        return _functions.setdefault((key, name), fn)  # one kernel object per instantiation, kept


def get_global(filename: str, name_expressions: Sequence[str], name: str, dtype, count: Optional[int] = None,
               arch: Optional[str] = None) -> np.ndarray:
    """The value of the ``__device__`` array ``name`` (one of the family's name expressions, e.g.
    ``"mla::sm90::kGeometry"``) of the family's module on the current device: ``count`` elements of
    ``dtype`` (the whole array when ``count`` is None), copied to the host once and kept."""
    import cupy

    key, module = _module(filename, name_expressions, name, arch)
    cache_key = (key, name, cupy.cuda.runtime.getDevice())
    got = _globals.get(cache_key)
    if got is None:
        mangled = module.module.mapping.get(name, name)  # NVRTC's lowered name of the expression
        ptr = module.get_global(mangled)
        dtype = np.dtype(dtype)
        if count is None:
            count = int(ptr.mem.size) // dtype.itemsize  # the symbol's size, from cuModuleGetGlobal
        got = np.zeros(int(count), dtype)
        cupy.cuda.runtime.memcpy(got.ctypes.data, ptr.ptr, got.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        got.flags.writeable = False
        with _registry_lock:
            got = _globals.setdefault(cache_key, got)
    return got


def compile_offline(filename: str, name_expressions: Sequence[str], arch: str, method: str = "cubin") -> bytes:
    """Compile without a GPU (NVRTC only) and return the cubin (or PTX with ``method='ptx'``).

    Used by CI to check every template instantiation for every target architecture. Relies on
    CuPy's private ``_NVRTCProgram`` (tested against CuPy 14.2).
    """
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import compiler

    opts = assemble_cupy_compiler_options(_options(arch))
    if method == "ptx":
        opts = tuple(o.replace("-arch=sm_", "-arch=compute_") for o in opts)
    prog = compiler._NVRTCProgram(kernel_source(filename), filename, name_expressions=list(name_expressions), method=method)
    try:
        out, _mapping = prog.compile(opts)
    except compiler.CompileException as exc:
        raise KernelCompileError(f"compiling {filename} for {arch} failed; instantiations {list(name_expressions)}:\n{exc}") from exc
    return out


def compiled_modules() -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(file, arch, name expressions) of every module compiled in this process."""
    with _registry_lock:
        return [(k.filename, k.arch, k.name_expressions) for k in _modules]


def compile_count() -> int:
    """How many modules this process compiled (or loaded from CuPy's disk cache)."""
    return _compiles


def iter_sources() -> Iterable[str]:
    return iter(_RAW_SOURCES)
