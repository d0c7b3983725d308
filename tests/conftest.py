from __future__ import annotations

import functools
import signal

import pytest

from plait.cluster import has_net_admin

NET_ADMIN = has_net_admin()


@functools.cache
def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_configure(config: pytest.Config) -> None:
    """Let Ctrl-C be Ctrl-C in the suite and in every process it starts.

    A non-interactive shell starts a background job (`make test &`) with SIGINT ignored,
    and an ignored signal stays ignored across exec: the tests that press Ctrl-C on a job
    (`tests/faults/test_teardown.py`) would then hang or fail on a job that never saw it.
    A handler set here is reset to the default in the processes the tests start.
    """
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cluster` tests without CAP_NET_ADMIN and `gpu` tests without CUDA."""
    no_ns = pytest.mark.skip(reason="needs root or CAP_NET_ADMIN to build network namespaces")
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available())")
    for item in items:
        if "cluster" in item.keywords and not NET_ADMIN:
            item.add_marker(no_ns)
        if "gpu" in item.keywords and not _cuda():
            item.add_marker(no_gpu)
