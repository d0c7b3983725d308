from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

from plait.train.loop import build_optimizer
from plait.train.optim import Muon32, MuonAdamW, orthogonalise


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.Flatten(),
        nn.Linear(2 * 6 * 6, 8),
        nn.ReLU(),
        nn.LayerNorm(8),
        nn.Linear(8, 3),
    )


def _train(model: nn.Module, opts: list[torch.optim.Optimizer], steps: int) -> None:
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        for o in opts:
            o.zero_grad()
        model(x).pow(2).mean().backward()
        for o in opts:
            o.step()


def test_muon_adamw_matches_stock_muon_plus_adamw() -> None:
    """Bit-identical to torch's Muon on the 2-D weights plus torch's AdamW on the rest
    (conv kernel, biases, norm): the same kernels run on the same tensors in the same order."""
    ours, ref = _model(), _model()
    opt = build_optimizer("muon", ours.parameters(), lr=0.01, weight_decay=0.01)
    assert isinstance(opt, MuonAdamW)
    mats = [p for p in ref.parameters() if p.ndim == 2]
    rest = [p for p in ref.parameters() if p.ndim != 2]
    stock = [
        torch.optim.Muon(mats, lr=0.01, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.01, weight_decay=0.01),
    ]
    _train(ours, [opt], 3)
    _train(ref, stock, 3)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
    # one learning rate reaches both halves (K-FAC and schedules read param_groups)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = [p.detach().clone() for p in ours.parameters()]
    _train(ours, [opt], 1)
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters(), strict=True))


def test_muon32_in_bfloat16_is_torchs_muon() -> None:
    """Asked for torch's own bfloat16 iteration, Muon32 computes torch's Muon bit for bit
    (momentum, Nesterov, weight decay, the RMS-matched rate): only the type differs."""
    ours, ref = _model(), _model()
    kw: dict = {"lr": 0.02, "weight_decay": 0.01, "adjust_lr_fn": "match_rms_adamw"}
    mine = [p for p in ours.parameters() if p.ndim == 2]
    stock = [p for p in ref.parameters() if p.ndim == 2]
    _train(ours, [Muon32(mine, ns_dtype=torch.bfloat16, **kw)], 3)
    _train(ref, [torch.optim.Muon(stock, **kw)], 3)
    for a, b in zip(mine, stock, strict=True):
        assert torch.equal(a, b)


def test_orthogonalise_in_float32_tracks_float64() -> None:
    """The float32 iteration is the float64 one up to float32 rounding (1e-5 over five
    steps of products of unit-scale matrices), where bfloat16's 8-bit mantissa is off by
    about 1e-2; both tall and wide matrices."""
    coeffs = (3.4445, -4.7750, 2.0315)
    for shape in ((12, 30), (30, 12)):
        g = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
        exact = orthogonalise(g.double(), torch.float64, coeffs, 5, 1e-7)
        f32 = orthogonalise(g, torch.float32, coeffs, 5, 1e-7)
        bf16 = orthogonalise(g, torch.bfloat16, coeffs, 5, 1e-7)
        assert f32.dtype == torch.float32 and f32.shape == shape
        assert (f32.double() - exact).abs().max() < 1e-5
        assert (bf16.double() - exact).abs().max() > 1e-3
        # Muon's polar-factor surrogate: singular values pulled into about (0.5, 1.5)
        sv = torch.linalg.svdvals(exact)
        assert sv.min() > 0.4 and sv.max() < 1.6


def test_muon_fp32_optimizer_keeps_float32_and_trains() -> None:
    model = _model()
    opt = build_optimizer("muon-fp32", model.parameters(), lr=0.01)
    assert isinstance(opt, MuonAdamW)
    assert any(isinstance(o, Muon32) and o.ns_dtype == torch.float32 for o in opt._inner())
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    first = model(x).pow(2).mean().item()
    _train(model, [opt], 5)
    assert model(x).pow(2).mean().item() < first


def test_muon_adamw_state_dict_round_trip() -> None:
    model = _model()
    opt = MuonAdamW(model.parameters(), lr=0.01)
    _train(model, [opt], 2)
    clone = copy.deepcopy(model)
    resumed = MuonAdamW(clone.parameters(), lr=0.5)
    # a copy, as a checkpoint on disk is: a loaded state dict shares tensors of the same
    # dtype and device with its source, and both optimizers go on training here
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert [g["lr"] for g in resumed.param_groups] == [0.01, 0.01]
    _train(model, [opt], 2)
    _train(clone, [resumed], 2)
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)


def test_sgd_plain_has_no_momentum() -> None:
    """The same gradient twice: plain SGD moves lr * g both times, where SGD with the
    trainer's default momentum (0.9) would move 1.9 * lr * g the second time."""
    w = nn.Parameter(torch.zeros(3))
    opt = build_optimizer("sgd-plain", [w], lr=0.5)
    g = torch.tensor([1.0, -2.0, 4.0])
    moves = []
    for _ in range(2):
        before = w.detach().clone()
        w.grad = g.clone()
        opt.step()
        moves.append(w.detach() - before)
    torch.testing.assert_close(moves[0], -0.5 * g, rtol=0, atol=0)
    torch.testing.assert_close(moves[1], -0.5 * g, rtol=0, atol=0)


def test_heavyball_soap_runs_eagerly_and_trains() -> None:
    """heavyball's SOAP as the trainer builds it: its torch.compile switched off (the
    first step would otherwise compile for about 100 s) and a loss that falls."""
    pytest.importorskip("heavyball")  # the bench extra
    import heavyball
    import heavyball.utils

    model = _model()
    opt = build_optimizer("heavyball-soap", model.parameters(), lr=0.01)
    assert isinstance(opt, heavyball.SOAP) and heavyball.utils.compile_mode is None
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]


def test_heavyball_soap_without_heavyball_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "heavyball", None)  # import heavyball raises ImportError
    with pytest.raises(
        ValueError, match=r"heavyball-soap needs heavyball: pip install 'plait\[bench\]'"
    ):
        build_optimizer("heavyball-soap", [nn.Parameter(torch.zeros(2))], lr=0.1)
