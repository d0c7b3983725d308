"""Gradient compressors, each a DDP communication hook with state.

Importing this package registers every compressor by name (and, through
`plait.train.strategies.dp`, as a training and benchmark strategy of the same name).
"""

from __future__ import annotations

from plait.dp.compress.acpsgd import ACPSGD
from plait.dp.compress.allreduce import AllReduce
from plait.dp.compress.base import Compressor, compressor_class, compressor_names
from plait.dp.compress.cast import BF16, FP16, CastAllReduce
from plait.dp.compress.lowrank import LowRankCompressor, RankPolicy
from plait.dp.compress.powersgd import PowerSGD
from plait.dp.compress.sign import SignSGD
from plait.dp.compress.topk import TopK
from plait.dp.compress.torch_powersgd import TorchPowerSGD

__all__ = [
    "ACPSGD",
    "BF16",
    "FP16",
    "AllReduce",
    "CastAllReduce",
    "Compressor",
    "LowRankCompressor",
    "PowerSGD",
    "RankPolicy",
    "SignSGD",
    "TopK",
    "TorchPowerSGD",
    "compressor_class",
    "compressor_names",
]
