"""The per-device compute token that co-located jobs pass between them.

Several independent jobs (separate launches, separate process groups) share a device. A
job may compute (forward and backward) only while it holds the device's token and hands it
on as soon as its backward is done, so another job computes while the first one waits for
its gradient communication. The token is a first-in first-out ticket lock kept in a small
memory-mapped file:

- fair: tickets are served in the order they were taken, so no job starves;
- crash-safe: every ticket records its owner's pid, and a waiter that finds the ticket
  being served owned by a dead process (or abandoned by an interrupted waiter) skips it,
  so a crashed job never blocks the others;
- bounded: a holder that keeps the token longer than `timeout_s` is reported with a clear
  error instead of stalling everyone forever;
- private: the file lives in a directory only the current user can open (mode 0700, a
  real directory and not a symbolic link), on the local machine, and is opened without
  following links, so another user can neither reach the token nor point plait's writes
  at a file of theirs choosing;
- never hangs on a bad file: a file that is not a token (wrong size or header) is refused
  when opened, and every wait (the file lock included) ends in `TokenTimeoutError`.

Updates happen under `fcntl.flock` and are a few memory writes; waiting polls the mapped
counters with a short back-off and no system calls.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from plait._proc import pid_alive

_SLOTS = 128
_HEADER = 8  # int64 words before the slot ring
_SIZE = 8 * (_HEADER + _SLOTS)
_NEXT, _SERVING, _HOLDER, _SINCE, _GRANTS = 0, 1, 2, 3, 4
_ABANDONED = -1
_MAGIC_WORD = 7  # last header word: marks a file as a token of this layout
_MAGIC = int.from_bytes(b"plaitTK1", "little")
#: Longest the file lock may be waited for: it is held for a few memory writes, so a
#: longer wait means a process is stuck holding it (or the file is shared with a stranger).
LOCK_TIMEOUT_S = 10.0
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


class TokenTimeoutError(TimeoutError):
    """The token was held (or waited for) longer than the configured timeout."""


def token_dir() -> Path:
    """Per-user directory of token files (0700), on local storage.

    The directory is `plait-crossover-<uid>` under $PLAIT_TOKEN_DIR, else $XDG_RUNTIME_DIR,
    else the system's temporary folder. In a shared folder such as /tmp another user may
    have created that name first (as a directory of theirs or a link to any directory), so
    an existing one must be a real directory, owned by this user, with mode 0700: anything
    else is refused rather than repaired, since the token's writes would land where the
    other user chose.

    Raises:
        PermissionError: the path exists and is not a private directory of this user.
    """
    base = os.environ.get("PLAIT_TOKEN_DIR") or os.environ.get("XDG_RUNTIME_DIR")
    root = Path(base) if base else Path(tempfile.gettempdir())
    path = root / f"plait-crossover-{os.getuid()}"
    root.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    check_private_dir(path)
    return path


def check_private_dir(path: Path) -> None:
    """Refuse `path` unless it is a real directory (not a link) of this user with mode 0700.

    Raises:
        PermissionError: naming what is wrong and what is required.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise PermissionError(f"token directory {path} does not exist") from None
    if stat.S_ISLNK(st.st_mode):
        raise PermissionError(
            f"token directory {path} is a symbolic link (to {os.readlink(path)!r}); it must be "
            f"a real directory of uid {os.getuid()} with mode 0700: remove it, or set "
            "PLAIT_TOKEN_DIR to a private folder"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"token directory {path} is not a directory")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{path} must belong to uid {os.getuid()} with mode 0700 (it is "
            f"uid {st.st_uid}, mode {oct(st.st_mode & 0o777)}): another user could reach the token"
        )


def device_key() -> str:
    """The device this process computes on: its node (host, or emulated node) and local rank.

    Jobs co-located on one device must agree on this key; on the emulated cluster the node is
    the namespace (PLAIT_CLUSTER/PLAIT_NODE), on a real cluster the host name.
    """
    node = os.environ.get("PLAIT_NODE")
    cluster = os.environ.get("PLAIT_CLUSTER")
    host = f"{cluster}-n{node}" if node is not None and cluster else socket.gethostname()
    local = os.environ.get("LOCAL_RANK", "0")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"{host}-d{local}")


@dataclass
class TokenStats:
    """What one process saw of the token: how often and how long it waited and held it."""

    acquisitions: int = 0
    wait_s: float = 0.0
    hold_s: float = 0.0
    max_wait_s: float = 0.0
    skipped_dead: int = 0
    waits: list[float] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict[str, float]:
        n = max(1, self.acquisitions)
        return {
            "acquisitions": self.acquisitions,
            "wait_s": self.wait_s,
            "hold_s": self.hold_s,
            "mean_wait_s": self.wait_s / n,
            "max_wait_s": self.max_wait_s,
            "skipped_dead": self.skipped_dead,
        }


class ComputeToken:
    """A FIFO, crash-safe compute token shared by every process that names the same file.

    Args:
        group: name shared by the co-located jobs (letters, digits, ``_.-``).
        key: the device; by default `device_key()`.
        timeout_s: longest a holder may keep the token (and a waiter wait) before
            `TokenTimeoutError` is raised in the waiter.
        directory: where token files live (default `token_dir()`).
    """

    def __init__(
        self,
        group: str,
        *,
        key: str | None = None,
        timeout_s: float = 300.0,
        directory: Path | None = None,
    ) -> None:
        if not _NAME_RE.match(group):
            raise ValueError(
                f"invalid crossover group {group!r}: use 1-64 letters, digits, '_', '.' or '-'"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if key is not None and not _KEY_RE.match(key):
            raise ValueError(f"invalid device key {key!r}: use letters, digits, '_', '.' or '-'")
        self.group = group
        self.key = key or device_key()
        self.timeout_s = timeout_s
        folder = directory if directory is not None else token_dir()
        check_private_dir(folder)
        self.path = folder / f"{group}.{self.key}.token"
        self._fd = -1
        fd = _open_token(self.path)
        try:
            with _locked(fd, self.path):
                _init_or_check(fd, self.path)
            self._map = mmap.mmap(fd, _SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._ticket: int | None = None
        self._held_since = 0.0
        self.stats = TokenStats()
        self._pid = os.getpid()

    # ------------------------------------------------------------ raw words
    def _get(self, i: int) -> int:
        return int(struct.unpack_from("<q", self._map, 8 * i)[0])

    def _set(self, i: int, value: int) -> None:
        struct.pack_into("<q", self._map, 8 * i, value)

    def _slot(self, ticket: int) -> int:
        return _HEADER + ticket % _SLOTS

    # --------------------------------------------------------------- public
    @property
    def held(self) -> bool:
        return self._ticket is not None and self._get(_SERVING) == self._ticket

    def acquire(self) -> None:
        """Block until this process holds the token (re-entrant calls are no-ops)."""
        if self.held:
            return
        start = time.monotonic()
        with _locked(self._fd, self.path):
            ticket = self._get(_NEXT)
            self._set(_NEXT, ticket + 1)
            self._set(self._slot(ticket), self._pid)
        self._ticket = ticket
        try:
            self._wait_turn(ticket, start)
        except BaseException:
            with _locked(self._fd, self.path):  # let the others skip this ticket
                self._set(self._slot(ticket), _ABANDONED)
            self._ticket = None
            raise
        now = time.monotonic()
        waited = now - start
        self._held_since = now
        self.stats.acquisitions += 1
        self.stats.wait_s += waited
        self.stats.max_wait_s = max(self.stats.max_wait_s, waited)
        self.stats.waits.append(waited)

    def _wait_turn(self, ticket: int, start: float) -> None:
        pause = 20e-6
        next_check = 0.0
        while True:
            serving = self._get(_SERVING)
            if serving == ticket:
                with _locked(self._fd, self.path):
                    self._set(_HOLDER, self._pid)
                    self._set(_SINCE, time.monotonic_ns())
                    self._set(_GRANTS, self._get(_GRANTS) + 1)
                return
            if serving > ticket:
                raise AssertionError(f"token {self.path} skipped live ticket {ticket}")
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.005
                self._skip_dead(serving)
                held_for = (time.monotonic_ns() - self._get(_SINCE)) / 1e9
                if held_for < 0:  # a hand-off time in the future is no time: count from here
                    held_for = now - start
                if now - start > self.timeout_s and held_for > self.timeout_s:
                    holder = self._get(_HOLDER)
                    raise TokenTimeoutError(
                        f"compute token {self.path.name}: process {holder} has held it for "
                        f"{held_for:.0f}s (timeout {self.timeout_s:.0f}s); is that job stalled?"
                    )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)

    def _skip_dead(self, serving: int) -> None:
        with _locked(self._fd, self.path):
            while True:
                serving = self._get(_SERVING)
                if serving >= self._get(_NEXT):
                    return
                owner = self._get(self._slot(serving))
                if owner == self._pid or (owner != _ABANDONED and pid_alive(owner)):
                    return
                self._set(_SERVING, serving + 1)
                self._set(_HOLDER, 0)
                self._set(_SINCE, time.monotonic_ns())
                self.stats.skipped_dead += 1

    def release(self) -> None:
        """Hand the token to the next ticket; a no-op when not held."""
        if not self.held:
            self._ticket = None
            return
        assert self._ticket is not None
        with _locked(self._fd, self.path):
            self._set(self._slot(self._ticket), 0)
            self._set(_HOLDER, 0)
            self._set(_SINCE, time.monotonic_ns())
            self._set(_SERVING, self._ticket + 1)
        self.stats.hold_s += time.monotonic() - self._held_since
        self._ticket = None

    def close(self) -> None:
        """Release and unmap; called at exit so a finishing job never keeps the token."""
        if self._fd < 0:
            return
        with contextlib.suppress(Exception):
            self.release()
        self._map.close()
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> ComputeToken:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def grants(self) -> int:
        """Total acquisitions by all processes since the file was created."""
        return self._get(_GRANTS)


def _open_token(path: Path) -> int:
    """Open (or create, 0600) the token file without following a link at its name.

    O_NONBLOCK keeps a FIFO planted at the name from blocking the open; only a regular file
    of this user is kept.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise PermissionError(
                f"compute token {path} is a symbolic link; refusing to follow it (remove it)"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise PermissionError(
                f"compute token {path} is not a regular file of uid {os.getuid()}; remove it"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _init_or_check(fd: int, path: Path) -> None:
    """Lay out a new (empty) token file, or check that an existing one is a token."""
    size = os.fstat(fd).st_size
    if size == 0:
        os.ftruncate(fd, _SIZE)
        os.pwrite(fd, struct.pack("<q", _MAGIC), 8 * _MAGIC_WORD)
        return
    words = struct.unpack("<8q", os.pread(fd, 8 * _HEADER, 0)) if size == _SIZE else ()
    # Files written before the header carried its mark have a zero there; their counters
    # must still make sense to be taken as tokens.
    if (
        not words
        or words[_MAGIC_WORD] not in {0, _MAGIC}
        or not (0 <= words[_SERVING] <= words[_NEXT] <= words[_SERVING] + _SLOTS)
    ):
        raise ValueError(
            f"{path} is not a plait compute token ({size} bytes, unknown header); "
            "remove it if no job is using it"
        )
    if words[_MAGIC_WORD] == 0:
        os.pwrite(fd, struct.pack("<q", _MAGIC), 8 * _MAGIC_WORD)


@contextlib.contextmanager
def _locked(fd: int, path: Path) -> Iterator[None]:
    """Hold the file's lock, waiting at most `LOCK_TIMEOUT_S` for it."""
    timeout_s = LOCK_TIMEOUT_S
    deadline = time.monotonic() + timeout_s
    pause = 1e-4
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TokenTimeoutError(
                    f"compute token {path.name}: its file lock was held for over "
                    f"{timeout_s:.0f}s; a process is stuck holding it"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
