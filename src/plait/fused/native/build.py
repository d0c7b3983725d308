"""Compile `kernels.c` on first use, once per size, and load it into the process.

The kernels' sizes are compile-time constants, so each (sequence length, head width) of
attention and each layer-norm width gets its own small library, built in about a second
by the machine's C compiler and cached on disk under a key of everything that shapes the
binary: the source, the compiler and its flags, the sizes and the CPU's instruction set
(`-march=native`, so a cache shared between different machines never hands one another's
binary over). A build writes a temporary file and renames it into place, so processes
that build the same library at once never load a half-written one.

Loading a shared library runs its constructors, so the cache is trusted no further than
the files in it can be: the folder must be this user's, mode 0700 (it is created so, and
a looser one of the user's that nobody else can write is tightened), under parents no one
else can rename it in. A folder others can write is refused with a warning and the
libraries are built in a private temporary folder instead. Each library has a sidecar
naming its key and the SHA-256 of its bytes, written at build time; a library is loaded
from the very file descriptor whose bytes were hashed, only if it is a regular file of
this user that no one else can write and both match, and is rebuilt otherwise.

The libraries use OpenMP and must share torch's runtime: two runtimes in one process
would each spin their own threads against the other's. They link `libgomp.so.1`, which
the dynamic loader resolves to the copy torch has already loaded, so the kernels are
offered only where torch's parallel backend is that libgomp (Linux builds of torch).
Elsewhere, without a compiler, or with `PLAIT_NATIVE=0`, every layer keeps its torch
path, which computes the same function.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
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
#: -fno-trapping-math lets the vectoriser turn a condition between computed values into a
#: select (without it gcc keeps such loops scalar: 3.3x slower attention, measured), and
#: -ffp-contract=fast lets it fuse a multiply and an add into one FMA, which ISO C mode
#: forbids by default (each product then takes two instructions and rounds twice).
FLAGS = ("-O3", "-march=native", "-std=c11", "-fno-math-errno", "-fno-trapping-math",
         "-ffp-contract=fast", "-fPIC", "-shared", "-fopenmp")  # fmt: skip
#: Longest a build may take before the kernels are given up on.
BUILD_TIMEOUT_S = 120.0

_P, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "attention_forward": [_P, _P, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _F32, _INT],
    "attention_backward": [_P, _P, _P, _P, _I64, _I64, _F32, _INT],
    "layer_norm_forward": [_P, _P, _P, _P, _P, _P, _I64, _I64, _F32, _INT, _INT],
    "layer_norm_backward": [_P, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _INT, _INT],
    "adam_step": [_I64, _P, _P, _P, _P, _P, _P, _I64, _I64, _P, _F32, _F32, _F32, _F32, _INT],
    "dropout_apply": [_P, _P, _I64, _I64, _P, ctypes.c_uint64, _INT],
    "gelu_tanh_forward": [_P, _P, _I64, _INT],
    "rotary_forward": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "rotary_backward": [_P, _P, _P, _P, _I64, _I64, _I64, _INT],
    "gelu_tanh_backward": [_P, _P, _P, _I64, _INT],
    "attention_heads_forward": [
        *[_P] * 7,
        *[_I64] * 3,
        _INT,
        _P,
        _I64,
        ctypes.c_uint64,
        _F32,
        _INT,
    ],
    "attention_heads_backward": [*[_P] * 9, *[_I64] * 3, _P, _I64, ctypes.c_uint64, _F32, _INT],
}

_lock = threading.Lock()
_loaded_fds: list[int] = []
_refused: set[tuple[Path, str]] = set()
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
            lib = _open_verified(sizes)
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


def cache_problem(folder: Path) -> str | None:
    """Why libraries in `folder` cannot be trusted, or None when it is private to this user.

    The folder itself must be a directory of this user that no one else can write; each
    parent must belong to this user or root and be writable by no one else unless sticky
    (as /tmp is), since whoever can write a parent can swap the folder for one of theirs.
    """
    uid = os.getuid()
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"{folder} cannot be inspected ({exc.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory"
    if st.st_uid != uid:
        return f"{folder} belongs to uid {st.st_uid}, not to this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"{folder} is writable by others (mode {oct(st.st_mode & 0o777)})"
    for parent in folder.resolve().parents:
        pst = os.stat(parent)
        if pst.st_uid not in {uid, 0}:
            return f"its parent {parent} belongs to uid {pst.st_uid}"
        if pst.st_mode & 0o022 and not pst.st_mode & stat.S_ISVTX:
            return f"its parent {parent} is writable by others (mode {oct(pst.st_mode & 0o777)})"
    return None


def library_dir() -> Path:
    """The folder libraries are built in and loaded from: the cache when it is private.

    A missing cache folder (and its `plait` parent) is created with mode 0700; one that is
    the user's and nobody else can write is tightened to 0700. A folder others could have
    planted libraries in is refused with a warning, and this process builds in a private
    temporary folder of its own, removed at exit.
    """
    folder = cache_dir()
    try:
        folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        problem = cache_problem(folder)
        if problem is None and stat.S_IMODE(os.lstat(folder).st_mode) != 0o700:
            os.chmod(folder, 0o700)
    except OSError as exc:
        problem = f"{folder} cannot be created ({exc.strerror})"
    if problem is None:
        return folder
    private = _private_dir()
    if (folder, problem) not in _refused:  # once per folder and reason, not once per size
        _refused.add((folder, problem))
        log.warning(
            "plait native kernel cache refused: %s; building in the private folder %s "
            "instead (set %s to a folder only you can write)",
            problem,
            private,
            ENV_CACHE,
        )
    return private


@cache
def _private_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="plait-native-"))  # mode 0700
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def _command(sizes: dict[str, int]) -> tuple[list[str], str]:
    """The compiler command for `sizes` and the library's key (a digest of what shapes it)."""
    cc = compiler()
    assert cc is not None
    defines = [f"-D{name}={int(value)}" for name, value in sorted(sizes.items())]
    command = [cc, *FLAGS, *defines]
    digest = hashlib.sha256()
    for part in (
        SOURCE.read_bytes(),
        " ".join(command).encode(),
        _compiler_version(cc),
        _cpu_signature(),
    ):
        digest.update(part)
        digest.update(b"\0")
    return command, digest.hexdigest()[:20]


def library_path(sizes: dict[str, int], folder: Path | None = None) -> Path:
    """Where the library for `sizes` lives (in `folder`, default the cache folder)."""
    _, key = _command(sizes)
    return (folder or cache_dir()) / f"kernels-{key}.so"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _open_verified(sizes: dict[str, int]) -> ctypes.CDLL:
    """Load the library for `sizes`, building it first when missing or not trustworthy."""
    folder = library_dir()
    command, key = _command(sizes)
    path = folder / f"kernels-{key}.so"
    for attempt in range(2):
        fd, problem = _verified_fd(path, key)
        if fd is not None:
            # dlopen the descriptor that was hashed: a file swapped in at the name after
            # the check is never the one loaded. The descriptor stays open as long as the
            # library stays loaded (for good): the loader knows a library by its name, and
            # a reused descriptor number would hand back the library loaded under it.
            try:
                lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
            except BaseException:
                os.close(fd)
                raise
            _loaded_fds.append(fd)
            return lib
        if attempt == 0 and problem is not None:
            log.warning("plait native kernel %s: %s; rebuilding it", path, problem)
        if attempt == 0:
            _build(command, key, path)
    raise OSError(f"the library just built at {path} does not verify: {problem}")


def _verified_fd(path: Path, key: str) -> tuple[int | None, str | None]:
    """An open descriptor of `path` when it is trustworthy, else None and why (None: absent)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot be opened ({exc.strerror})"
    try:
        st = os.fstat(fd)
        problem: str | None
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            problem = (
                f"not a regular file of this user that no one else can write (uid {st.st_uid}, "
                f"mode {oct(st.st_mode & 0o777)})"
            )
        else:
            digest = hashlib.sha256()
            while chunk := os.read(fd, 1 << 20):
                digest.update(chunk)
            problem = _check_sidecar(_sidecar(path), key, digest.hexdigest())
        if problem is None:
            return fd, None
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None, problem


def _check_sidecar(sidecar: Path, key: str, sha256: str) -> str | None:
    try:
        fd = os.open(sidecar, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        return f"its digest file cannot be read ({exc.strerror})"
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            return "its digest file is not this user's alone"
        fields = f.read(256).decode(errors="replace").split()
    if fields != [sha256, key]:
        return "it does not match the key and digest recorded when it was built"
    return None


def _build(command: list[str], key: str, path: Path) -> None:
    """Compile into a temporary file, record its digest, then rename both into place."""
    tag = f"{os.getpid()}.{threading.get_ident()}.tmp"
    tmp = path.with_name(f".{path.name}.{tag}")
    tmp_sidecar = path.with_name(f".{_sidecar(path).name}.{tag}")
    try:
        done = subprocess.run(
            [*command, str(SOURCE), "-o", str(tmp), "-lm"],
            check=False,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise OSError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-500:]}")
        os.chmod(tmp, 0o700)  # whatever the umask, nobody else may write it
        sha256 = hashlib.sha256(tmp.read_bytes()).hexdigest()
        fd = os.open(tmp_sidecar, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{sha256} {key}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        os.replace(tmp_sidecar, _sidecar(path))
    finally:
        tmp.unlink(missing_ok=True)
        tmp_sidecar.unlink(missing_ok=True)


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
