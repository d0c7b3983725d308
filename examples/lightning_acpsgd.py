"""PyTorch Lightning's DDP strategy with plait's ACP-SGD as its communication hook.

Lightning builds the DistributedDataParallel model itself; plait supplies the hook and its
state, which is how Lightning takes any DDP communication hook:

    state, hook = plait.dp.comm_hook("acpsgd:rank=4")
    strategy = DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)

Lightning registers such hooks on CUDA devices only (it skips them on CPU without a word),
so on CPU the small `CommHookOnCPU` callback below registers the same pair before the
first step. The LightningModule is an MLP on scikit-learn's digits (shipped with
scikit-learn: nothing is downloaded).

Run it with either launcher, unchanged:

    torchrun --nproc-per-node 2 examples/lightning_acpsgd.py --max-steps 50
    plait run --nodes 2 -- examples/lightning_acpsgd.py
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import plait.dp

logger = logging.getLogger("lightning_acpsgd")


class DigitsMLP(L.LightningModule):
    """A user's own model: a two-hidden-layer MLP trained with SGD and momentum."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class CommHookOnCPU(L.Callback):
    """Register the strategy's communication hook where Lightning does not (CPU, gloo)."""

    def __init__(self, state: Any, hook: plait.dp.CommHook) -> None:
        self.state, self.hook = state, hook

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        model = trainer.strategy.model
        if trainer.strategy.root_device.type == "cpu" and isinstance(
            model, DistributedDataParallel
        ):
            model.register_comm_hook(self.state, self.hook)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--compression", default="acpsgd:rank=4", help="any plait compressor spec")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    x, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y))
    # Lightning adds the DistributedSampler itself
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)

    state, hook = plait.dp.comm_hook(args.compression)
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = DDPStrategy(
        process_group_backend="nccl" if cuda else "gloo", ddp_comm_state=state, ddp_comm_hook=hook
    )
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=local,
        num_nodes=world // local,
        strategy=strategy,
        max_steps=args.max_steps,
        callbacks=[CommHookOnCPU(state, hook)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    torch.manual_seed(0)
    model = DigitsMLP(args.lr)
    trainer.fit(model, loader)
    steps = state.state_dict().get("steps", "?")
    logger.info(
        "rank %d: %s steps averaged by %s, last loss %.4f",
        trainer.global_rank,
        steps,
        state.name,
        trainer.callback_metrics["loss"].item(),
    )


if __name__ == "__main__":
    main()
