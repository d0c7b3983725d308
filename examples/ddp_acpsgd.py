"""A plain torchrun DDP training script, switched to ACP-SGD by one line.

An MLP classifies scikit-learn's handwritten digits (the data ships with scikit-learn:
nothing is downloaded). Everything is stock PyTorch except the line that wraps the model:

    # model = DistributedDataParallel(model)
    model = plait.data_parallel(model, "acpsgd:rank=4")

Snapshots make it resumable: after every epoch each rank saves the model's state dict
(which holds ACP-SGD's error-feedback residuals and factors next to the weights), the
optimizer and the epoch, atomically (write a temporary file, then rename). Started again
with the same arguments, it continues from the last complete epoch.

Run it with either launcher, unchanged:

    torchrun --nproc-per-node 2 examples/ddp_acpsgd.py --epochs 1
    plait run --nodes 2 -- examples/ddp_acpsgd.py
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import plait

logger = logging.getLogger("ddp_acpsgd")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--snapshot-dir", type=Path, default=Path("snapshots/ddp_acpsgd"))
    p.add_argument("--max-steps", type=int, default=0, help="stop each epoch early (0: never)")
    return p.parse_args()


def digits() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    xs = torch.tensor(x, dtype=torch.float32) / 16.0
    ys = torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(0)  # the same split on every rank
    order = torch.randperm(len(ys), generator=g)
    train, test = order[:1500], order[1500:]
    return TensorDataset(xs[train], ys[train]), TensorDataset(xs[test], ys[test])


def save_snapshot(path: Path, state: dict[str, object]) -> None:
    """Write `state` to `path` so that a crash leaves the old snapshot or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    train_set, test_set = digits()
    sampler: DistributedSampler[tuple[torch.Tensor, ...]] = DistributedSampler(
        train_set, shuffle=True, seed=0
    )
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    ).to(device)
    # model = DistributedDataParallel(model)
    model = plait.data_parallel(model, "acpsgd:rank=4")
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # every rank keeps its own snapshot: ACP-SGD's error-feedback residuals differ by rank
    snapshot = args.snapshot_dir / f"rank{rank}-of{world}.pt"
    start = 0
    if snapshot.exists():
        state = torch.load(snapshot, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"]
        logger.info("rank %d: resumed from %s after epoch %d", rank, snapshot, start)

    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for step, (x, y) in enumerate(loader):
            if args.max_steps and step >= args.max_steps:
                break
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            opt.step()
        save_snapshot(
            snapshot,
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch + 1},
        )
        model.eval()
        with torch.no_grad():
            x, y = test_set.tensors
            accuracy = (model(x.to(device)).argmax(1) == y.to(device)).float().mean().item()
        if rank == 0:
            logger.info(
                "epoch %d: last loss %.4f, test accuracy %.3f", epoch + 1, loss.item(), accuracy
            )
    # Free the DDP wrapper before its process group: a reducer that outlives the group
    # and is freed last can hang gloo's teardown at exit (plait's wrappers guard against
    # it, a stock DDP does not).
    del model, opt
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
