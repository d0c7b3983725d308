"""Horizontally fused training arrays (HFTA): train B models of one architecture as one.

`plait.fuse(factory, n=B)` rewrites an ordinary nn.Module so that B copies train in one
pass, every tensor leading with the model dimension B ([B, N, ...]). Fused optimizers and
schedulers take each hyper-parameter as one value or one per model; `to_models()` exports
each model for the stock module. `plait.fused.sweep` runs Optuna sweeps as fused arrays.
"""

from __future__ import annotations

from plait.fused.array import check_same_structure
from plait.fused.capture import CapturedArray
from plait.fused.convert import Capture, Fallback, FusedArray, fuse
from plait.fused.errors import StructureMismatchError, UnsupportedLayerError
from plait.fused.losses import accuracy, cross_entropy, mse_loss, per_model_loss
from plait.fused.lr_scheduler import (
    CosineAnnealingLR,
    FusedLRScheduler,
    LinearWarmupLR,
    MultiStepLR,
    OneCycleLR,
    StepLR,
)
from plait.fused.ops.conv import CONV_LAYOUTS, set_conv_layout
from plait.fused.optim import (
    FusedAdagrad,
    FusedAdam,
    FusedAdamW,
    FusedOptimizer,
    FusedRMSprop,
    FusedSGD,
)
from plait.fused.vmap import VmapArray

__all__ = [
    "CONV_LAYOUTS",
    "Capture",
    "CapturedArray",
    "CosineAnnealingLR",
    "Fallback",
    "FusedAdagrad",
    "FusedAdam",
    "FusedAdamW",
    "FusedArray",
    "FusedLRScheduler",
    "FusedOptimizer",
    "FusedRMSprop",
    "FusedSGD",
    "LinearWarmupLR",
    "MultiStepLR",
    "OneCycleLR",
    "StepLR",
    "StructureMismatchError",
    "UnsupportedLayerError",
    "VmapArray",
    "accuracy",
    "check_same_structure",
    "cross_entropy",
    "fuse",
    "mse_loss",
    "per_model_loss",
    "set_conv_layout",
]
