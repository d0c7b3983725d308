"""K-FAC on Hugging Face models nobody here wrote: GPT-2 (Conv1D projections, tied
embeddings) and Llama (separate q/k/v, gated MLP, RMSNorm), built from tiny configs.

Parity: two gloo workers, each with half the batch through `plait.data_parallel`, must
precondition exactly like one process with the whole batch. Everything is float64 and
dropout is off, so the only differences are summation order in the factor all-reduce
and DDP's gradient average: ~1e-12 relative, far inside the 1e-5 asked for, while a
wrongly scaled, transposed or missing factor shows up as O(1e-1).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from plait.comm.cost import AlphaBeta
from plait.kfac import KFAC, KFACConfig, KFACCosts
from plait.kfac.layers import LinearLayer, make_layer
from plait.testing import run_distributed

transformers = pytest.importorskip("transformers")

STEPS = 2
BATCH, SEQ, VOCAB = 4, 8, 32
CONFIG = KFACConfig(damping=0.01, factor_decay=0.9, kl_clip=0.01, lr=0.1, probe=False)
#: Given costs: no probe, no timed decomposition, the same placement on every rank.
COSTS = KFACCosts(link=AlphaBeta.from_rate(1e9), inverse_s_per_n3=1e-10, flop_s=1e-11)


def _gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=16,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model: nn.Module = transformers.GPT2LMHeadModel(cfg).double()
    return model


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model: nn.Module = transformers.LlamaForCausalLM(cfg).double()
    return model


MODELS = {"gpt2": _gpt2, "llama": _llama}


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _train(
    model: nn.Module, rank: int, world: int, approximation: str = "expand"
) -> list[list[torch.Tensor]]:
    """Preconditioned gradients of `STEPS` SGD steps on this rank's shard."""
    import plait

    module = model
    if world > 1:
        model = plait.data_parallel(model, "ssgd")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = replace(CONFIG, approximation=approximation)
    kfac = KFAC(model, cfg, optimizer=opt, costs=COSTS)
    shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    out = []
    for step in range(STEPS):
        ids = _tokens(step)[shard]
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        kfac.step()
        out.append([p.grad.detach().clone() for p in module.parameters() if p.grad is not None])
        opt.step()
    kfac.remove()
    return out


def _workers(rank: int, world: int, approximation: str) -> dict[str, Any]:
    return {name: _train(make(), rank, world, approximation) for name, make in MODELS.items()}


@pytest.mark.parametrize("approximation", ["expand", "reduce"])
def test_gpt2_and_llama_distributed_match_single_process(approximation: str) -> None:
    """Reduce's rows are per sample (mean over the sequence), so it is as independent of
    the split as expand, and it must precondition differently from expand."""
    refs = {name: _train(make(), 0, 1, approximation) for name, make in MODELS.items()}
    if approximation == "reduce":
        expand = {name: _train(make(), 0, 1) for name, make in MODELS.items()}
        for name in MODELS:
            diff = max(
                float((r - e).norm() / e.norm())
                for r, e in zip(refs[name][-1], expand[name][-1], strict=True)
            )
            assert diff > 1e-3, f"{name}: reduce preconditions like expand ({diff:.1e})"
    per_rank = run_distributed(_workers, approximation, world_size=2, timeout_s=300)
    for results in per_rank:
        for name, steps in results.items():
            for got, want in zip(steps, refs[name], strict=True):
                for g, w in zip(got, want, strict=True):
                    rel = float((g - w).norm() / w.norm().clamp(min=1e-30))
                    assert rel < 1e-5, f"{name}: {rel:.2e}"


def test_gpt2_conv1d_is_preconditioned_and_the_tied_weight_left_alone() -> None:
    model = _gpt2()
    kfac = KFAC(model, CONFIG, costs=COSTS)
    conv1d = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8 and set(conv1d) <= set(kfac.layers)
    assert "transformer.wte" not in kfac.layers and "lm_head" not in kfac.layers
    assert kfac.stats.shared == ["transformer.wte & lm_head"]
    # position ids [1, seq] are shared by the batch: left alone at the first step
    assert "transformer.wpe" in kfac.layers
    ids = _tokens(0)
    model(input_ids=ids, labels=ids).loss.backward()
    kfac.step()
    assert "transformer.wpe" not in kfac.layers and kfac.stats.batch_shared == ["transformer.wpe"]
    assert {s.layer for s in kfac.pipeline.slots} == set(kfac.layers)


@pytest.mark.parametrize("mode", ["kfac", "ekfac", "soap"])
def test_conv1d_preconditions_exactly_like_the_equivalent_linear(mode: str) -> None:
    """A Conv1D and an nn.Linear holding the transposed weight are the same function, so
    every mode must give the same new gradient (transposed back)."""
    torch.manual_seed(0)
    conv = transformers.pytorch_utils.Conv1D(5, 3).double()
    lin = nn.Linear(3, 5).double()
    with torch.no_grad():
        lin.weight.copy_(conv.weight.t())
        lin.bias.copy_(conv.bias)
    layer = make_layer("c", conv)
    assert isinstance(layer, LinearLayer) and layer.transposed
    assert layer.a_shape.dim == 4 and layer.g_shape.dim == 5
    x, target = torch.randn(6, 2, 3, dtype=torch.float64), torch.randn(6, 2, 5).double()
    grads = []
    for module in (conv, lin):
        k = KFAC(module, KFACConfig(mode=mode, kl_clip=None), costs=COSTS)
        nn.functional.mse_loss(module(x), target).backward()
        k.step()
        assert module.weight.grad is not None and module.bias.grad is not None
        grads.append((module.weight.grad, module.bias.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0].t(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-10, atol=1e-12)
