"""Tiny `transformers` models built from configs (no weights, nothing downloads)."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 64
SEQ = 16


def gpt2(*, heads: int = 4, width: int = 32, tied: bool = False, layers: int = 2) -> Any:
    """GPT-2: Conv1D layers, fused q/k/v; untied so that pipelines may split it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=layers,
        n_head=heads,
        n_embd=width,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def llama(*, heads: int = 4, width: int = 32, layers: int = 2, kv_heads: int | None = None) -> Any:
    """Llama: separate q/k/v, grouped-query attention (`kv_heads`, default half the
    heads), gated MLP, rotary positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or (heads // 2 if heads % 2 == 0 else heads),
        hidden_size=width,
        intermediate_size=2 * width,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )
    return LlamaForCausalLM(cfg)


def bert() -> Any:
    """BERT (masked LM head): post-norm encoder layers."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        tie_word_embeddings=False,
    )
    return BertForMaskedLM(cfg)


HF_MODELS: dict[str, Any] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    # four blocks and as many key/value heads as heads: tp=4 and pp=4 divide them
    "gpt2-4": lambda: gpt2(layers=4),
    "llama-4": lambda: llama(layers=4, kv_heads=4),
}


def llama_workload() -> Any:
    """A user workload (``tests.parallel.hf_models:llama_workload``) of the tiny Llama."""
    from torch.utils.data import TensorDataset

    from plait.workloads import DataInfo, DataSplit, Task, Workload

    def real() -> DataSplit:
        x = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(0))
        info = DataInfo(input_shape=(SEQ,), num_classes=VOCAB, block_size=SEQ, input_vocab=VOCAB)
        return DataSplit(
            train=TensorDataset(x, torch.roll(x, -1, 1)), test=None, info=info, name="random tokens"
        )

    return Workload(
        name="tiny-llama",
        build=lambda info, **_: llama(),
        real=real,
        task=Task.LANGUAGE_MODEL,
        bench_batch=8,
        optimizer="adamw",
    )
