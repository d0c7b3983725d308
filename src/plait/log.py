"""Where a run's messages and scalars go: the ``plait`` loggers, and TensorBoard.

Library modules log to ``logging.getLogger(__name__)``, so every record lands in the
``plait`` hierarchy (``plait.train.loop``, ``plait.cluster.netns``, ...) and an embedding
application routes it like any other library's. Only entry points install a handler:
the command line (`configure`, with ``--verbose``/``--quiet``) and the worker processes it
launches, which inherit its level through ``PLAIT_LOG_LEVEL``.

`summary_writer` opens a `torch.utils.tensorboard.SummaryWriter`, importing TensorBoard
only when asked so that it stays an optional extra (``pip install plait[tensorboard]``).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

#: The root of plait's logger hierarchy.
LOGGER = "plait"
#: Environment variable that carries the level to worker processes.
LEVEL_ENV = "PLAIT_LOG_LEVEL"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever `sys.stderr` is at the time of each record.

    A handler installed once would otherwise keep the stream of its first caller (a
    replaced or closed one under test runners and in-process CLI calls).
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


class _Formatter(logging.Formatter):
    """Plain messages at INFO (what a command reports), a ``plait: warning:`` style prefix
    above it; with DEBUG on, every record says where it came from."""

    def __init__(self, *, detailed: bool) -> None:
        super().__init__()
        self.detailed = detailed

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        if self.detailed:
            return f"{record.levelname.lower()} {record.name}: {text}"
        if record.levelno >= logging.WARNING:
            return f"plait: {record.levelname.lower()}: {text}"
        return text


def level_from(verbose: bool = False, quiet: bool = False) -> int:
    """The level ``--verbose`` (DEBUG) / ``--quiet`` (WARNING) / neither (INFO) selects."""
    if verbose and quiet:
        raise ValueError("--verbose and --quiet exclude each other")
    return logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO


def configure(level: int | str | None = None) -> logging.Logger:
    """Send the ``plait`` loggers' records to stderr at `level`; idempotent.

    Args:
        level: a `logging` level or its name; None reads ``PLAIT_LOG_LEVEL`` (INFO when
            unset). The level is exported to ``PLAIT_LOG_LEVEL`` so the workers this
            process launches log alike.

    Returns:
        the ``plait`` logger.
    """
    if level is None:
        level = os.environ.get(LEVEL_ENV, "INFO")
    if isinstance(level, str):
        named = logging.getLevelName(level.strip().upper())
        if not isinstance(named, int):
            raise ValueError(f"{LEVEL_ENV}={level!r}: expected DEBUG, INFO, WARNING or ERROR")
        level = named
    logger = logging.getLogger(LOGGER)
    for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
        logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.setFormatter(_Formatter(detailed=level <= logging.DEBUG))
    logger.addHandler(handler)
    logger.setLevel(level)
    os.environ[LEVEL_ENV] = logging.getLevelName(level)
    return logger


def check_tensorboard(log_dir: str | os.PathLike[str]) -> None:
    """Fail early, in the parent, when `summary_writer` would fail for want of TensorBoard.

    Raises:
        ValueError: TensorBoard is not installed (it is an optional extra).
    """
    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError(
            f"--tensorboard {str(log_dir)!r}: TensorBoard is not installed; "
            "pip install 'plait[tensorboard]' (or tensorboard>=2.16)"
        )


def summary_writer(log_dir: str | os.PathLike[str]) -> SummaryWriter:
    """A TensorBoard `SummaryWriter` writing event files under `log_dir`.

    Raises:
        ValueError: TensorBoard is not installed (it is an optional extra).
    """
    check_tensorboard(log_dir)
    from torch.utils.tensorboard import SummaryWriter

    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return SummaryWriter(log_dir=str(log_dir))
