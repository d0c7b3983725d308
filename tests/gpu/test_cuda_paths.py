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


def _train_data_parallel(device: str, backend: str, spec: str) -> list[torch.Tensor]:
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        model = plait.data_parallel(_net().to(device), spec)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _batches(4):
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().cpu() for p in model.parameters()]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("spec", ["acpsgd:rank=2", "powersgd:rank=2"])
def test_data_parallel_compressor_on_cuda_matches_cpu(spec: str) -> None:
    """The low-rank compressors' state (error feedback, factors, send buffers) lives on the
    gradients' device (ACP-SGD's was once allocated on the CPU and failed on CUDA)."""
    cpu = _train_data_parallel("cpu", "gloo", spec)
    cuda = _train_data_parallel("cuda", "nccl", spec)
    for a, b in zip(cpu, cuda, strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("spec", ["signsgd", "topk", "fp16", "bf16", "torch-powersgd:rank=2"])
def test_data_parallel_compressor_trains_on_cuda(spec: str) -> None:
    """Sign, top-k and the casts round differently on two devices (a flipped sign, another
    k-th element, a bf16 rounding step), so the CPU is no bit-level reference for them;
    PyTorch's own Power-SGD hook cannot run on the CPU of a machine with CUDA (it calls
    ``torch.cuda.synchronize`` on the tensors' CPU device). On CUDA they must train, move
    the weights and stay finite."""
    start = [p.detach() for p in _net().parameters()]
    after = _train_data_parallel("cuda", "nccl", spec)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(start, after, strict=True))


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


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_kfac_conv_factors_on_cuda_match_cpu(approximation: str) -> None:
    """The convolution adapter's strided patches (expand) and mean patches (reduce), and
    the batched packed factor products, on CUDA as on the CPU."""

    def grads(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=2), nn.ReLU(),
            nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
        ).to(device)  # fmt: skip
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        kfac = KFAC(model, KFACConfig(damping=0.01, approximation=approximation), optimizer=opt)
        g = torch.Generator().manual_seed(2)
        x, y = torch.randn(6, 3, 8, 8, generator=g), torch.randint(0, 5, (6,), generator=g)
        nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
        kfac.step()
        return [p.grad.detach().cpu() for p in model.parameters() if p.grad is not None]

    for a, b in zip(grads("cpu"), grads("cuda"), strict=True):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_kfac_cuda_benchmark_runs() -> None:
    from plait.bench.kfac_cuda import ENTRIES, measure

    rows = measure(workload="mlp", batch=16, steps=2, warmup=1)
    assert [r["label"] for r in rows] == [label for label, _ in ENTRIES]
    assert rows[0]["vs_sgd"] == 1.0 and all(r["median_s"] > 0 for r in rows)
