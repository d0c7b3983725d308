"""The data-parallel, K-FAC and fused paths on CUDA, against the same code on the CPU.

Marked `gpu`: skipped where ``torch.cuda.is_available()`` is false (tests/conftest.py).
One process and one device each (NCCL refuses two ranks on one GPU), so these check that
the kernels and hooks run on CUDA and agree with the CPU, not multi-GPU communication.
"""

from __future__ import annotations

import copy
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn

import plait
from plait.fused import FusedSGD, cross_entropy
from plait.kfac import KFAC, KFACConfig

pytestmark = pytest.mark.gpu

# float32 on two devices: different kernels sum in different orders, ~1e-6 relative per
# step; a few steps of SGD stay well inside 1e-4.
RTOL, ATOL = 1e-4, 1e-5


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_data_parallel(device: str, backend: str) -> list[torch.Tensor]:
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        model = plait.data_parallel(_net().to(device), "acpsgd:rank=2")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(4):
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


def test_data_parallel_compressor_on_cuda_matches_cpu() -> None:
    cpu = _train_data_parallel("cpu", "gloo")
    cuda = _train_data_parallel("cuda", "nccl")
    for a, b in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def _kfac_gradients(device: str) -> list[torch.Tensor]:
    model = _net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kfac = KFAC(model, KFACConfig(damping=0.01), optimizer=opt)
    x, y = _batches(1)[0]
    nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    kfac.step()
    return [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]


def test_kfac_preconditioning_on_cuda_matches_cpu() -> None:
    for a, b in zip(_kfac_gradients("cpu"), _kfac_gradients("cuda"), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_fused_array_on_cuda_matches_cpu() -> None:
    models = [_net() for _ in range(4)]
    results = []
    for device in ("cpu", "cuda"):
        array = plait.fuse([copy.deepcopy(m) for m in models]).to(device)
        opt = FusedSGD(array.parameters(), lr=[0.05, 0.1, 0.2, 0.4])
        for x, y in _batches(3):
            xb = x.to(device).expand(4, *x.shape)
            losses = cross_entropy(array(xb), y.to(device))
            opt.zero_grad()
            losses.sum().backward()
            opt.step()
        results.append([p.detach().cpu() for p in array.parameters()])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
