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

Compile-time switches of the kernels (``kernels/sm90/config.cuh``, e.g. ``MLA_SM90_SMEM_EPILOGUE``) can be
set for a whole process with the environment variable ``MLA_CUPY_DEFINES``, read once at import:
``NAME=VALUE`` items separated by commas or spaces (``MLA_CUPY_DEFINES=MLA_SM90_SMEM_EPILOGUE=0``), each
compiled as ``#define NAME VALUE`` at the top of every kernel source (a test or measurement run
of another build; the cache keys cover them, as they cover the sources).
"""
from __future__ import annotations

import os
import posixpath
import re
import struct
import threading
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .dims import KERNEL_DIR

__all__ = [
    "KERNEL_DIR",
    "KernelCompileError",
    "kernel_source",
    "source_with_includes",
    "get_function",
    "get_global",
    "device_symbol",
    "compile_offline",
    "compile_offline_with_log",
    "compile_source_offline_with_log",
    "OfflineBuild",
    "PtxasFunction",
    "parse_ptxas_log",
    "WGMMA_SERIALIZED",
    "arch_for_capability",
    "compiled_modules",
    "compile_count",
]

# Read once at import: path under kernels/ (e.g. "sm90/config.cuh") -> text.
_RAW_SOURCES: Dict[str, str] = {
    p.relative_to(KERNEL_DIR).as_posix(): p.read_text(encoding="utf-8")
    for p in sorted(KERNEL_DIR.rglob("*")) if p.suffix in (".cu", ".cuh")
}

_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)
_DEFINE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_defines(text: str) -> Dict[str, str]:
    """``"A=1,B=2"`` (commas or spaces between items) -> ``{"A": "1", "B": "2"}``; a bare ``A`` is
    ``A=1``. Raises ``ValueError`` on a name that is not a C identifier."""
    out: Dict[str, str] = {}
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        name, _, value = item.partition("=")
        if not _DEFINE_RE.match(name):
            raise ValueError(f"MLA_CUPY_DEFINES: {item!r} is not NAME=VALUE")
        out[name] = value if value else "1"
    return out


#: Compile-time switches of every kernel compiled in this process (``MLA_CUPY_DEFINES``).
DEFINES: Dict[str, str] = parse_defines(os.environ.get("MLA_CUPY_DEFINES", ""))


def _define_lines(defines: Optional[Dict[str, str]]) -> str:
    return "".join(f"#define {k} {v}\n" for k, v in (defines or {}).items())


def kernel_source(filename: str, defines: Optional[Dict[str, str]] = None) -> str:
    """Return the full text of ``kernels/<filename>`` with local includes inlined (once each),
    after ``#define`` lines for :data:`DEFINES` and then ``defines`` (a name in both takes the
    value of ``defines``).

    A local ``#include "x"`` is resolved against the including file's folder, as a C++ compiler
    does (``"../common.cuh"`` from ``sm90/config.cuh`` is ``common.cuh``)."""
    if filename not in _RAW_SOURCES:
        raise FileNotFoundError(f"mla_cupy kernel source {filename!r} not found in {KERNEL_DIR}")
    return source_with_includes(_RAW_SOURCES[filename], filename, defines)


def source_with_includes(text: str, filename: str, defines: Optional[Dict[str, str]] = None) -> str:
    """:func:`kernel_source` for a text that is not one of the package's sources (a benchmark's
    probe kernel): its local includes are resolved as if it were ``kernels/<filename>``."""
    seen: set = {filename}

    def inline(text: str, name: str) -> str:
        folder = posixpath.dirname(name)
        return _INCLUDE_RE.sub(lambda m: expand(posixpath.normpath(posixpath.join(folder, m.group(1)))),
                               text.replace("#pragma once", ""))

    def expand(name: str) -> str:
        if name not in _RAW_SOURCES:
            raise FileNotFoundError(f"mla_cupy kernel source {name!r} not found in {KERNEL_DIR}")
        if name in seen:
            return ""
        seen.add(name)
        return inline(_RAW_SOURCES[name], name)

    merged = {**DEFINES, **(defines or {})}
    return _define_lines(merged) + f"// ---- {filename} (local includes inlined) ----\n" + inline(text, filename)


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


def get_global(filename: str, name_expressions: Sequence[str], name: str, dtype, count: int,
               arch: Optional[str] = None) -> np.ndarray:
    """The first ``count`` elements of ``dtype`` of the ``__device__`` array ``name`` (one of the
    family's name expressions, e.g. ``"mla::sm90::kGeometry"``) of the family's module on the
    current device, copied to the host once (per count) and kept."""
    import cupy

    key, module = _module(filename, name_expressions, name, arch)
    dtype = np.dtype(dtype)
    cache_key = (key, name, cupy.cuda.runtime.getDevice(), dtype, int(count))
    got = _globals.get(cache_key)
    if got is None:
        mangled = module.module.mapping.get(name, name)  # NVRTC's lowered name of the expression
        ptr = module.get_global(mangled)
        got = np.zeros(int(count), dtype)
        cupy.cuda.runtime.memcpy(got.ctypes.data, ptr.ptr, got.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
        got.flags.writeable = False
        with _registry_lock:
            got = _globals.setdefault(cache_key, got)
    return got


def device_symbol(filename: str, name_expressions: Sequence[str], symbol: str, arch: Optional[str] = None):
    """The device memory (a ``cupy.cuda.MemoryPointer``) of the ``extern "C" __device__`` variable
    ``symbol`` of the family's module on the current device (compiled on first use), to read or
    write afresh: diagnostics such as the Hopper kernel's cycle stamps (``MLA_SM90_TRACE``)."""
    _key, module = _module(filename, name_expressions, name_expressions[0], arch)
    return module.get_global(symbol)


#: ptxas' advisories that wgmma instructions were serialized (the "C75xx" family: extern calls,
#: function boundaries, register pressure, non-wgmma instructions touching wgmma registers inside a
#: pipeline stage, compiler-inserted waits in divergent paths, ...): every line that names wgmma
#: and a serialization, whatever its code.
WGMMA_SERIALIZED = re.compile(r"wgmma.*serializ", re.IGNORECASE)

#: ptxas' advisory code at the start of a message, e.g. ``(C7511)``.
_ADVISORY_CODE = re.compile(r"\((C\d{4})\)")

#: What ``compile_offline`` asks of ptxas for a cubin: its per-function report (registers, stack
#: frame, spill stores and loads, shared memory, barriers) in the program log.
_PTXAS_VERBOSE = "--ptxas-options=-v"


@dataclass(frozen=True)
class PtxasFunction:
    """One function of ptxas' ``-v`` report (kernels and non-inlined device functions).

    Attributes
    ----------
    name : str
        The mangled (lowered) name.
    stack_frame, spill_stores, spill_loads : int
        Bytes of local memory per thread: the stack frame, and the bytes ptxas spills to it and
        loads back.
    registers : int or None
        Registers per thread (kernels only; a device function reports none).
    smem : int
        Bytes of static shared memory (dynamic shared memory is set at launch).
    barriers : int
        Named barriers used.
    """

    name: str
    stack_frame: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    registers: Optional[int] = None
    smem: int = 0
    barriers: int = 0

    @property
    def spills(self) -> bool:
        """Whether the function uses local memory at all (a stack frame, spill stores or loads)."""
        return bool(self.stack_frame or self.spill_stores or self.spill_loads)


@dataclass(frozen=True)
class OfflineBuild:
    """What :func:`compile_offline_with_log` returns.

    Attributes
    ----------
    binary : bytes or str
        The cubin (the whole ELF) or the PTX.
    log : str
        NVRTC's program log: front-end warnings, ptxas' advisories (``(C7511) ...``) and, for a
        cubin, ptxas' ``-v`` report of every function.
    lowered : dict
        Name expression -> lowered (mangled) name, as the cubin and the log spell it.
    """

    binary: Union[bytes, str]
    log: str
    lowered: Dict[str, str]

    def functions(self) -> Dict[str, PtxasFunction]:
        """ptxas' report per function (mangled name -> :class:`PtxasFunction`); empty for PTX."""
        return parse_ptxas_log(self.log)

    def advisories(self) -> List[str]:
        """ptxas' coded advisories (lines with ``(Cdddd)``), in log order."""
        return [ln.strip() for ln in self.log.splitlines() if _ADVISORY_CODE.search(ln)]

    def serialized_wgmma(self) -> List[str]:
        """The log lines saying that wgmma instructions were serialized (:data:`WGMMA_SERIALIZED`)."""
        return [ln.strip() for ln in self.log.splitlines() if WGMMA_SERIALIZED.search(ln)]

    def global_bytes(self, name: str) -> bytes:
        """The initial bytes of the ``__device__`` global ``name`` (a name expression of the build,
        e.g. ``"mla::sm90::kParamLayout"``) in the cubin: what :func:`get_global` reads from a
        loaded module, without a GPU."""
        return _elf_symbol(self.binary, self.lowered.get(name, name))


_FN_START = re.compile(r"(?:Compiling entry function|Function properties for) '?([^' ]+)'?")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")


def parse_ptxas_log(log: str) -> Dict[str, PtxasFunction]:
    """ptxas' ``-v`` report in ``log`` per function: mangled name -> :class:`PtxasFunction`.

    The report names a function (``Compiling entry function 'f'`` or ``Function properties for
    f``), then its stack line and, for a kernel, its ``Used N registers`` line."""
    found: Dict[str, dict] = {}
    current: Optional[str] = None
    for line in log.splitlines():
        m = _FN_START.search(line)
        if m:
            current = m.group(1)
            found.setdefault(current, {})
            continue
        if current is None:
            continue
        m = _STACK.search(line)
        if m:
            found[current].update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)),
                                  spill_loads=int(m.group(3)))
        m = _USED.search(line)
        if m:
            found[current]["registers"] = int(m.group(1))
            for key, rx in (("smem", _SMEM), ("barriers", _BARRIERS)):
                mm = rx.search(line)
                if mm:
                    found[current][key] = int(mm.group(1))
    return {name: PtxasFunction(name, **fields) for name, fields in found.items()}


def _elf_symbol(elf: bytes, symbol: str) -> bytes:
    """The bytes of ``symbol`` in a 64-bit ELF (a cubin): its section's data at the symbol's value
    (zeros for a section without data)."""
    if not isinstance(elf, bytes) or elf[:4] != b"\x7fELF":
        raise ValueError("not an ELF: global_bytes reads a cubin (method='cubin')")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    # (type, offset, size, link) of each section header
    sections = [struct.unpack_from("<4xI16xQQI", elf, shoff + i * shentsize) for i in range(shnum)]
    want = symbol.encode()
    for kind, offset, size, link in sections:
        if kind != 2:  # SHT_SYMTAB
            continue
        names = sections[link][1]
        for at in range(offset, offset + size, 24):
            name, _, _, index, value, nbytes = struct.unpack_from("<IBBHQQ", elf, at)
            if elf[names + name:names + name + len(want) + 1] == want + b"\0":
                sec_kind, sec_offset = sections[index][:2]
                return bytes(nbytes) if sec_kind == 8 else elf[sec_offset + value:sec_offset + value + nbytes]  # 8: NOBITS
    raise KeyError(f"{symbol}: no such symbol in the ELF")


def _whole_elf(data: bytes) -> bytes:
    """The cubin NVRTC produced, whole: CuPy 14's ``getCUBIN`` returns it one byte short (it
    drops the last byte as if it were a string's terminating NUL; that byte is the zero high byte
    of the ELF's last table entry). The ELF header says where its tables end; a cubin exactly
    one byte shorter than that gets its NUL back, anything else is returned as it is."""
    if not isinstance(data, bytes) or data[:4] != b"\x7fELF" or data[4] != 2 or len(data) < 64:
        return data  # not a 64-bit ELF
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(phoff + phentsize * phnum, shoff + shentsize * shnum)
    return data + b"\0" if end == len(data) + 1 else data


def compile_offline_with_log(filename: str, name_expressions: Sequence[str], arch: str,
                             method: str = "cubin", defines: Optional[Dict[str, str]] = None) -> OfflineBuild:
    """Compile without a GPU (NVRTC only): the cubin (or PTX with ``method='ptx'``), NVRTC's log
    and the lowered names; ``defines``: compile-time switches on top of :data:`DEFINES`
    (:func:`kernel_source`).

    A cubin is compiled with ptxas' ``-v``, so the log reports every function's registers,
    stack frame, spills and shared memory (:meth:`OfflineBuild.functions`), next to ptxas'
    advisories (:meth:`OfflineBuild.serialized_wgmma`). Relies on CuPy's private
    ``_NVRTCProgram`` (tested against CuPy 14.2).

    Raises
    ------
    KernelCompileError
        NVRTC rejected the source; the message names the instantiations and carries the log.
    """
    return compile_source_offline_with_log(kernel_source(filename, defines), filename, name_expressions, arch, method)


def compile_source_offline_with_log(source: str, filename: str, name_expressions: Sequence[str], arch: str,
                                    method: str = "cubin") -> OfflineBuild:
    """:func:`compile_offline_with_log` of a whole source text (:func:`kernel_source`,
    :func:`source_with_includes`); ``filename`` names it in messages."""
    import io

    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import compiler

    opts = assemble_cupy_compiler_options(_options(arch))
    if method == "ptx":
        opts = tuple(o.replace("-arch=sm_", "-arch=compute_") for o in opts)
    elif method == "cubin":
        opts += (_PTXAS_VERBOSE,)
    prog = compiler._NVRTCProgram(source, filename, name_expressions=list(name_expressions), method=method)
    log = io.StringIO()
    try:
        out, mapping = prog.compile(opts, log_stream=log)
    except compiler.CompileException as exc:
        raise KernelCompileError(f"compiling {filename} for {arch} failed; instantiations {list(name_expressions)}:\n{exc}") from exc
    if method == "cubin":
        out = _whole_elf(out)
    return OfflineBuild(out, log.getvalue().rstrip("\0"), dict(mapping or {}))


def compile_offline(filename: str, name_expressions: Sequence[str], arch: str, method: str = "cubin") -> bytes:
    """Compile without a GPU (NVRTC only) and return the cubin (or PTX with ``method='ptx'``):
    :func:`compile_offline_with_log` without the log.

    Used by CI to check every template instantiation for every target architecture.
    """
    return compile_offline_with_log(filename, name_expressions, arch, method).binary


def compiled_modules() -> List[Tuple[str, str, Tuple[str, ...]]]:
    """(file, arch, name expressions) of every module compiled in this process."""
    with _registry_lock:
        return [(k.filename, k.arch, k.name_expressions) for k in _modules]


def compile_count() -> int:
    """How many modules this process compiled (or loaded from CuPy's disk cache)."""
    return _compiles


def iter_sources() -> Iterable[str]:
    return iter(_RAW_SOURCES)
