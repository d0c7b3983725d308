"""Hugging Face `transformers` models as plait workloads: a user's factory file.

GPT-2, Llama, BERT and ResNet-18 are built from configs (nothing is downloaded) at the
sizes people sweep on a CPU, with data bundled in Python and its packages: character-level
language modelling of Python's own documentation (pydoc topics) for GPT-2 and Llama, the
scikit-learn digits as 64-token sequences for BERT and as images for ResNet-18. Every
command that takes ``--workload`` takes these factories:

    plait bench-fused --workload examples/transformers_workloads.py:gpt2 --n 4,16,32 \\
        --strategies fused,fallback,serial,vmap --threads 1,2
    plait sweep --workload examples/transformers_workloads.py:gpt2 --trials 16 --epochs 1

`gpt2_untied` is GPT-2 with its output layer untied from the token embedding, so that
K-FAC, which leaves a weight shared by two layers to the optimizer, preconditions both.

`plait.fuse` captures each model with torch.export and fuses it (`CapturedArray`): the
same code as one model, B models per kernel. The architecture options (`width`, `layers`)
are the models' keyword arguments, so a sweep may vary them (arrays then pool trials of
one shape).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch.nn.functional as F
import transformers
from torch import nn
from torch.utils.data import TensorDataset

from plait.data import load_digits_split, load_text_split, synthetic_tokens
from plait.workloads import DataInfo, DataSplit, Task, Workload, get_workload

#: Characters of context of the language models (and positions they know).
BLOCK = 32
#: Side of the images ResNet-18 sees: the 8x8 digits upsampled, CIFAR-sized stages.
IMAGE = 32


def _text() -> DataSplit:
    train, val, vocab = load_text_split(block_size=BLOCK)
    info = DataInfo(input_shape=(BLOCK,), num_classes=vocab.size, block_size=BLOCK)
    return DataSplit(train=train, test=val, info=info, name="pydoc-topics")


def _synthetic_text(n: int) -> DataSplit:
    vocab = _text().info.num_classes
    ds = synthetic_tokens(n=n, block_size=BLOCK, vocab_size=vocab)
    info = DataInfo(input_shape=(BLOCK,), num_classes=vocab, block_size=BLOCK)
    return DataSplit(train=ds, test=None, info=info, name="synthetic")


def _digit_images() -> DataSplit:
    """Digits as 1 x IMAGE x IMAGE images (bilinear upsampling of the 8 x 8 originals)."""
    train, test = load_digits_split(image=True)

    def upsample(ds: TensorDataset) -> TensorDataset:
        x, y = ds.tensors
        return TensorDataset(F.interpolate(x, size=(IMAGE, IMAGE), mode="bilinear"), y)

    info = DataInfo(input_shape=(1, IMAGE, IMAGE), num_classes=10)
    return DataSplit(train=upsample(train), test=upsample(test), info=info, name="digits")


def _gpt2(
    info: DataInfo, *, width: int = 32, layers: int = 2, tied: bool = True, **_: Any
) -> nn.Module:
    config = transformers.GPT2Config(
        vocab_size=info.num_classes, n_positions=info.block_size, n_embd=width,
        n_layer=layers, n_head=max(1, width // 16), use_cache=False,
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _llama(info: DataInfo, *, width: int = 32, layers: int = 2, **_: Any) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=info.num_classes, max_position_embeddings=info.block_size,
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=max(2, width // 8), num_key_value_heads=max(1, width // 16),
        use_cache=False, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _bert(info: DataInfo, *, width: int = 32, layers: int = 2, **_: Any) -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=info.input_vocab, max_position_embeddings=info.input_shape[0],
        hidden_size=width, intermediate_size=4 * width, num_hidden_layers=layers,
        num_attention_heads=max(1, width // 16),
    )  # fmt: skip
    config.num_labels = info.num_classes  # the classifier's outputs (sets the label maps too)
    return transformers.BertForSequenceClassification(config)


def _resnet18(info: DataInfo, *, width: int = 8, **_: Any) -> nn.Module:
    config = transformers.ResNetConfig(
        num_channels=info.input_shape[0], embedding_size=width,
        hidden_sizes=[width, 2 * width, 4 * width, 8 * width], depths=[2, 2, 2, 2],
        layer_type="basic",
    )  # fmt: skip
    config.num_labels = info.num_classes
    return transformers.ResNetForImageClassification(config)


def gpt2() -> Workload:
    """GPT-2 (Conv1D layers, GELU-tanh, tied embeddings), character-level LM."""
    return Workload(name="hf-gpt2", build=_gpt2, real=_text, synthetic=_synthetic_text,
                    task=Task.LANGUAGE_MODEL, description=gpt2.__doc__ or "", bench_batch=8,
                    train_batch=32, lr=1e-3, optimizer="adam", epochs=1)  # fmt: skip


def gpt2_untied() -> Workload:
    """GPT-2 with its output layer untied from the token embedding: two matrices that
    K-FAC preconditions (an embedding and a linear layer) where the tied one is left out."""
    return dataclasses.replace(gpt2(), name="hf-gpt2-untied",
                               build=functools.partial(_gpt2, tied=False),
                               description=gpt2_untied.__doc__ or "")  # fmt: skip


def llama() -> Workload:
    """Llama (RMSNorm, rotary embeddings, SiLU-gated MLP, grouped-query attention), LM."""
    return Workload(name="hf-llama", build=_llama, real=_text, synthetic=_synthetic_text,
                    task=Task.LANGUAGE_MODEL, description=llama.__doc__ or "", bench_batch=8,
                    train_batch=32, lr=1e-3, optimizer="adam", epochs=1)  # fmt: skip


def bert() -> Workload:
    """BERT for sequence classification of digits read as 64 pixel tokens."""
    # The digits as 64 pixel tokens: plait's own Transformer workload's data.
    digit_tokens = get_workload("digits-transformer").real
    return Workload(name="hf-bert", build=_bert, real=digit_tokens,
                    description=bert.__doc__ or "", bench_batch=8, train_batch=32, lr=1e-3,
                    optimizer="adam", epochs=3)  # fmt: skip


def resnet18() -> Workload:
    """ResNet-18 (basic blocks 2-2-2-2, batch norm) on upsampled digits."""
    return Workload(name="hf-resnet18", build=_resnet18, real=_digit_images,
                    description=resnet18.__doc__ or "", bench_batch=8, train_batch=32,
                    lr=0.05, optimizer="sgd", epochs=3)  # fmt: skip
