"""K-FAC on a vision model: a small ResNet over handwritten digits, data-parallel.

The model is Hugging Face transformers' ResNet, built from a small config (no weights, so
nothing is downloaded; torchvision and timm have no CPU wheel that installs beside this
torch). The data is scikit-learn's digits as 1x8x8 images. Two lines make it K-FAC
over data-parallel SGD:

    model = plait.data_parallel(model, "ssgd")             # or DistributedDataParallel
    kfac = KFAC(model, KFACConfig(inv_interval="auto"), optimizer=optimizer)
    ...
    loss.backward()
    kfac.step()                                             # preconditions the gradients
    optimizer.step()

K-FAC preconditions the convolutions and the classifier; the batch norms are left to the
optimizer (one log line lists them). ``inv_interval="auto"`` lets K-FAC choose how often
to invert from the measured step and the priced inversions on this network.

Run it with either launcher, unchanged:

    torchrun --nproc-per-node 2 examples/kfac_vision.py --steps 3
    plait run --nodes 2 -- examples/kfac_vision.py --steps 3
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import ResNetConfig, ResNetForImageClassification

import plait
from plait.kfac import KFAC, KFACConfig


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--damping", type=float, default=0.01)
    return p.parse_args()


def digits() -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out splits of the digits as [N, 1, 8, 8] images in [0, 1]."""
    x, y = load_digits(return_X_y=True)
    xs = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    ys = torch.tensor(y, dtype=torch.long)
    order = torch.randperm(len(ys), generator=torch.Generator().manual_seed(0))
    train, test = order[:1500], order[1500:]  # the same split on every rank
    return TensorDataset(xs[train], ys[train]), TensorDataset(xs[test], ys[test])


def resnet() -> nn.Module:
    """Two basic-block stages: 8x8 -> 2x2 after the stem, 1x1 after the second stage."""
    config = ResNetConfig(
        num_channels=1,
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="basic",
    )
    config.num_labels = 10  # the classifier's outputs (sets the label maps too)
    return ResNetForImageClassification(config)


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")  # rank, world and address from the launcher's env
    rank = dist.get_rank()

    train_set, test_set = digits()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train_set, shuffle=True, seed=0
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)  # the same initial weights on every rank
    model = plait.data_parallel(resnet(), "ssgd")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    kfac = KFAC(model, KFACConfig(damping=args.damping, inv_interval="auto"), optimizer=optimizer)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if step >= args.steps:
                break
            model.train()
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x).logits, y)
            loss.backward()
            kfac.step()
            optimizer.step()
            step += 1
            if rank == 0:
                print(f"step {step}: loss {loss.item():.4f}", flush=True)
            if not math.isfinite(loss.item()):
                raise RuntimeError(f"rank {rank}: the loss is {loss.item()} at step {step}")
        epoch += 1

    model.eval()
    with torch.no_grad():
        x, y = test_set.tensors
        accuracy = (model(x).logits.argmax(1) == y).float().mean().item()
    if rank == 0:
        print(
            f"held-out accuracy {accuracy:.3f} after {step} steps; K-FAC intervals: "
            f"factors every {kfac.intervals.factor}, inversions every {kfac.intervals.inv}",
            flush=True,
        )
    kfac.remove()
    dist.barrier()
    print(f"rank {rank}: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
