from __future__ import annotations

import functools

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `cluster` tests without CAP_NET_ADMIN and `gpu` tests without CUDA."""
    no_ns = pytest.mark.skip(reason="needs root or CAP_NET_ADMIN to build network namespaces")
    no_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available())")
    for item in items:
        if "cluster" in item.keywords and not NET_ADMIN:
            item.add_marker(no_ns)
        if "gpu" in item.keywords and not _cuda():
            item.add_marker(no_gpu)
