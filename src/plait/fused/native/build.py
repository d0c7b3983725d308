"""Compile `kernels.c` on first use, once per size, and load it into the process.

The kernels' sizes are compile-time constants, so each (sequence length, head width) of
attention and each layer-norm width gets its own small library, built in about a second
by the machine's C compiler and cached on disk under a key of everything that shapes the
binary: the source, the compiler and its flags, the sizes and the CPU's instruction set
(`-march=native`, so a cache shared between different machines never hands one another's
binary over). A build writes a temporary file and renames it into place, so processes
that build the same library at once never load a half-written one.

The libraries use OpenMP and must share torch's runtime: two runtimes in one process
would each spin their own threads against the other's. They link `libgomp.so.1`, which
the dynamic loader resolves to the copy torch has already loaded, so the kernels are
offered only where torch's parallel backend is that libgomp (Linux builds of torch).
Elsewhere, without a compiler, or with `PLAIT_NATIVE=0`, every layer keeps its torch
path, which computes the same function.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: Environment switch: "0" turns the native kernels off.
ENV_SWITCH = "PLAIT_NATIVE"
#: Environment override of the cache folder (default: $XDG_CACHE_HOME/plait or ~/.cache/plait).
ENV_CACHE = "PLAIT_CACHE_DIR"
SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ("-O3", "-march=native", "-std=c11", "-fno-math-errno", "-fPIC", "-shared", "-fopenmp")
#: Longest a build may take before the kernels are given up on.
BUILD_TIMEOUT_S = 120.0

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "attention_forward": [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _F32, _INT],
    "attention_backward": [_P, _P, _P, _P, _I64, _I64, _F32, _INT],
    "layer_norm_forward": [_P, _P, _P, _P, _P, _P, _I64, _I64, _F32, _INT],
    "layer_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT],
    "adam_step": [_I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _F32, _F32, _F32, _F32, _INT],
}

_lock = threading.Lock()
_libraries: dict[tuple[tuple[str, int], ...], ctypes.CDLL | None] = {}
_state = {"enabled": os.environ.get(ENV_SWITCH, "1").strip() != "0", "warned": False}


def enabled() -> bool:
    """Whether layers may use the native kernels (`PLAIT_NATIVE`, `set_enabled`)."""
    return bool(_state["enabled"])


def set_enabled(flag: bool) -> bool:
    """Turn the native kernels on or off for this process; returns the previous setting."""
    before = enabled()
    _state["enabled"] = bool(flag)
    return before


def load(**sizes: int) -> ctypes.CDLL | None:
    """The kernels compiled for `sizes` (SEQ, HEAD or WIDTH; none for the size-free
    optimizer kernel), or None where unavailable.

    The first call for a size builds or finds the library; a failure is logged once and
    remembered, and the caller falls back to torch.
    """
    if not enabled():
        return None
    key = tuple(sorted(sizes.items()))
    with _lock:
        if key not in _libraries:
            _libraries[key] = _load(sizes)
        return _libraries[key]


def _load(sizes: dict[str, int]) -> ctypes.CDLL | None:
    reason = unavailable_reason()
    lib = None
    if reason is None:
        try:
            lib = ctypes.CDLL(str(_build(sizes)))
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, None
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            reason = f"building the kernels failed: {exc}"
            lib = None
    if reason is not None and not _state["warned"]:
        _state["warned"] = True
        log.warning("plait native kernels unavailable (%s); using torch's kernels", reason)
    return lib


@cache
def unavailable_reason() -> str | None:
    """Why this process cannot use the native kernels, or None if it can."""
    if platform.system() != "Linux":
        return f"they need Linux, not {platform.system()}"
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return "torch's parallel backend is not OpenMP"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "/proc/self/maps is unreadable"
    if "libgomp" not in maps:
        return "torch's OpenMP runtime is not libgomp"
    if compiler() is None:
        return "no C compiler found (set CC)"
    return None


@cache
def compiler() -> str | None:
    """$CC, else the first of cc, gcc and clang on PATH."""
    names = [os.environ["CC"]] if os.environ.get("CC") else ["cc", "gcc", "clang"]
    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def cache_dir() -> Path:
    """Where built libraries live: $PLAIT_CACHE_DIR, else the user's cache folder."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "plait" / "native"


def _build(sizes: dict[str, int]) -> Path:
    cc = compiler()
    assert cc is not None
    defines = [f"-D{name}={int(value)}" for name, value in sorted(sizes.items())]
    command = [cc, *FLAGS, *defines]
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(command).encode(), _compiler_version(cc),
                 _cpu_signature()):  # fmt: skip
        digest.update(part)
        digest.update(b"\0")
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"kernels-{digest.hexdigest()[:20]}.so"
    if path.exists():
        return path
    tmp = folder / f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        done = subprocess.run([*command, str(SOURCE), "-o", str(tmp), "-lm"], check=False,
                              capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)  # fmt: skip
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-500:]}")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


@cache
def _compiler_version(cc: str) -> bytes:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return b""
    return out.stdout


@cache
def _cpu_signature() -> bytes:
    """The CPU's instruction-set flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return f"{platform.machine()} {line}".encode()
    except OSError:
        pass
    return platform.machine().encode()
