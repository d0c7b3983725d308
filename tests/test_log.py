from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from plait import log


@pytest.fixture
def plait_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The `plait` logger as `configure` leaves it, restored afterwards."""
    logger = logging.getLogger(log.LOGGER)
    handlers, level = list(logger.handlers), logger.level
    monkeypatch.delenv(log.LEVEL_ENV, raising=False)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_configure_is_idempotent_and_follows_stderr(
    plait_logger: logging.Logger, capsys: pytest.CaptureFixture[str]
) -> None:
    log.configure()
    log.configure()  # a second call (the CLI run twice in one process) adds no handler
    ours = [h for h in plait_logger.handlers if isinstance(h, log._StderrHandler)]
    assert len(ours) == 1
    child = logging.getLogger("plait.train.loop")
    child.info("epoch 1 | loss 0.5")
    child.warning("falling back to loopback")
    child.debug("not shown at INFO")
    assert capsys.readouterr().err.splitlines() == [
        "epoch 1 | loss 0.5",
        "plait: warning: falling back to loopback",
    ]


def test_level_reaches_workers_through_the_environment(
    plait_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    log.configure(logging.WARNING)
    assert os.environ[log.LEVEL_ENV] == "WARNING"
    log.configure(None)  # a worker: reads what its parent exported
    assert plait_logger.level == logging.WARNING
    monkeypatch.setenv(log.LEVEL_ENV, "chatty")
    with pytest.raises(ValueError, match="PLAIT_LOG_LEVEL='chatty'"):
        log.configure()


def test_missing_tensorboard_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'plait\[tensorboard\]'"):
        log.summary_writer(tmp_path / "tb")
    assert not (tmp_path / "tb").exists()
