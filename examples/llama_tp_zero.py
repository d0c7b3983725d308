"""Tensor + ZeRO parallelism of a Llama-style model built from a config, with plait.

Run it as any torchrun script, on one machine::

    torchrun --nproc-per-node 2 examples/llama_tp_zero.py --steps 3

or on plait's emulated multi-node cluster (one process per node)::

    plait run --nodes 2 -- examples/llama_tp_zero.py --steps 3

The model is `transformers`' Llama from a tiny config (no weights, nothing downloads).
`plait.parallelize` shards it: the tensor-parallel plan comes from the config's own
``base_model_tp_plan`` (q/k/v and gate/up by columns, o and down by rows), and ZeRO-3
(FSDP2) shards what remains over the data axis. Without an adapter written for it: the
one line that differs from single-process training is the ``parallelize`` call.
"""

from __future__ import annotations

import argparse
import logging

import torch

from plait import distributed as pdist
from plait.parallel import parallelize

logger = logging.getLogger("llama_tp_zero")


def build_model(*, layers: int, width: int, heads: int, vocab: int, seq: int) -> torch.nn.Module:
    """A Llama-style decoder from a config (same initial weights on every rank)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=2 * width,
        num_attention_heads=heads,
        num_key_value_heads=heads // 2,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument(
        "--plan", default=None, help="default: tp=2 with ZeRO-3 over the rest of the world"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    world = pdist.init_distributed()
    vocab = 128
    torch.set_num_threads(1)
    tp = 2 if world % 2 == 0 else 1
    plan = args.plan or (f"tp={tp},zero=3" if world > tp else f"tp={tp}")
    model = build_model(layers=2, width=64, heads=4, vocab=vocab, seq=args.seq)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    # the one plait line: spread model and optimizer over the world by the plan
    pmodel, optimizer = parallelize(model, optimizer, plan)

    g = torch.Generator().manual_seed(1)  # every rank draws the same global batches
    shard = args.batch // pmodel.data_parallel_size
    lo = pmodel.data_parallel_rank * shard
    losses = []
    for step in range(args.steps):
        # counting sequences from random starts: a pattern the model learns in a few steps
        start = torch.randint(0, vocab, (args.batch, 1), generator=g)
        x = (start + torch.arange(args.seq)) % vocab
        y = (x + 1) % vocab  # next-token targets
        optimizer.zero_grad()
        loss = pmodel.step(x[lo : lo + shard], y[lo : lo + shard])  # the ModelOutput's logits
        optimizer.step()
        losses.append(float(loss))
        if pdist.is_main():
            logger.info("step %d loss %.4f (plan %s)", step, float(loss), pmodel.plan.describe())
    pdist.shutdown()
    return losses


if __name__ == "__main__":
    main()
