"""`plait.data_parallel` with every compressor and local-update method, gated by
`plait.crossover.attach`, on Hugging Face models nobody here wrote: tiny GPT-2, BERT and
Llama built from configs.

One spawned world-size-2 job trains every family with every compressor in turn (spawning
and importing transformers costs more than the training), then the parent checks that:

- every compressor's losses are finite and fall on a fixed batch;
- the replicas stay in sync: after training, both ranks hold bit-identical parameters,
  which differ from the initial ones (a compressor that averaged differently on the two
  ranks, or a hook that skipped a bucket, would break this);
- the crossover gate took the compute token once per training step;
- S-SGD equals single-process training on the concatenated batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

import plait
from plait.crossover import attach
from plait.testing import run_distributed

STEPS = 4
BATCH = 4  # per rank
SEQ = 8
VOCAB = 64
LR = 0.05

#: every compressor with options that make it compress these small matrices
COMPRESSORS: dict[str, dict[str, Any]] = {
    "ssgd": {},
    "fp16": {},
    "bf16": {},
    "signsgd": {},
    "topk": {"ratio": 0.3},
    "powersgd": {"rank": 2},
    "torch-powersgd": {"rank": 2},
    "acpsgd": {"rank": 2},
    # local-update training (plait.dp.local): H = 2, so the 4 steps end on an exchange and
    # the replicas agree again; plain DiLoCo, and int4 pseudo-gradients over fragments
    "diloco": {"inner_steps": 2},
    "localsgd": {"inner_steps": 2, "compression": "int4", "block": 16},
}
#: signSGD's update has the size of the learning rate in every coordinate: Adam-sized
SIGN_LR = 1e-3


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel(cfg)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    cfg.num_labels = 3
    return BertForSequenceClassification(cfg)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


FAMILIES: dict[str, Callable[[], nn.Module]] = {"gpt2": _gpt2, "bert": _bert, "llama": _llama}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    return FAMILIES[family]()


def _batch(family: str, world: int) -> dict[str, torch.Tensor]:
    """The whole batch of every rank (a fixed batch: the losses must fall on it)."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH * world, SEQ), generator=g)
    if family == "bert":
        return {"input_ids": ids, "labels": torch.randint(0, 3, (BATCH * world,), generator=g)}
    return {"input_ids": ids, "labels": ids}


def _shard(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * BATCH : (rank + 1) * BATCH] for k, v in batch.items()}


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor]
) -> list[float]:
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        # the models' own loss (mean over tokens or samples): equal shards make the mean of
        # the ranks' means the mean over the concatenated batch
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _every_compressor(rank: int, world: int, family: str) -> dict[str, dict[str, Any]]:
    """Train each compressor from the same initial model on this rank's shard."""
    batch = _shard(_batch(family, world), rank)
    out: dict[str, dict[str, Any]] = {}
    for name, options in COMPRESSORS.items():
        model = _model(family)
        start = _flat(model)
        ddp = plait.data_parallel(model, name, **options)
        gate = attach(ddp, group=f"{family}-{name}")
        lr = SIGN_LR if name == "signsgd" else LR
        opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
        try:
            losses = _train(ddp, opt, batch)
        finally:
            gate.close()
            if isinstance(ddp, plait.dp.LocalUpdate):
                ddp.close()
            else:
                compressor = plait.dp.compressor_of(ddp)
                assert compressor is not None
                compressor.close()
        end = _flat(model)
        out[name] = {
            "losses": losses,
            "moved": (end - start).abs().max().item(),
            "params": end,
            "acquisitions": gate.stats.acquisitions,
        }
    return out


def _reference(family: str, world: int) -> tuple[list[float], torch.Tensor]:
    """S-SGD's reference: one process, the concatenated batch, stock SGD."""
    model = _model(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = _train(model, opt, _batch(family, world))
    return losses, _flat(model)


def _every_family(rank: int, world: int) -> dict[str, dict[str, dict[str, Any]]]:
    return {family: _every_compressor(rank, world, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every family and compressor, in one spawned job (spawning costs more than training)."""
    env = {"PLAIT_TOKEN_DIR": str(tmp_path_factory.mktemp("tokens"))}
    return run_distributed(_every_family, world_size=2, timeout_s=300, env=env)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_compressor_trains_in_sync(family: str, trained: list[dict[str, Any]]) -> None:
    ranks = [r[family] for r in trained]
    assert set(ranks[0]) == set(COMPRESSORS)
    for name in COMPRESSORS:
        r0, r1 = ranks[0][name], ranks[1][name]
        assert all(math.isfinite(v) for v in r0["losses"] + r1["losses"]), (name, r0["losses"])
        # a fixed batch per rank: a few steps of any of these averages lower the loss
        assert r0["losses"][-1] < r0["losses"][0], (name, r0["losses"])
        assert r1["losses"][-1] < r1["losses"][0], (name, r1["losses"])
        assert r0["moved"] > 0, name
        # replicas in sync: every rank applied the same averaged gradient, bit for bit
        assert torch.equal(r0["params"], r1["params"]), name
        assert r0["acquisitions"] == r1["acquisitions"] == STEPS, name

    ref_losses, ref_params = _reference(family, world=2)
    # fp32 gradients summed in another order (two half-batch sums, then gloo's sum) agree
    # to ~1e-7 relative per step; 4 momentum steps at lr 0.05 keep the drift under 1e-5
    torch.testing.assert_close(ranks[0]["ssgd"]["params"], ref_params, rtol=1e-5, atol=1e-6)
    # equal shards: the mean of the ranks' mean losses is the whole batch's mean loss
    mean = [
        (a + b) / 2
        for a, b in zip(ranks[0]["ssgd"]["losses"], ranks[1]["ssgd"]["losses"], strict=True)
    ]
    assert mean == pytest.approx(ref_losses, rel=1e-5)
