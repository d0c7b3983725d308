"""Distributed K-FAC with SPD-KFAC's pipelined factor communication and balanced inversion."""

from __future__ import annotations

from plait.kfac.config import KFACConfig
from plait.kfac.costs import KFACCosts
from plait.kfac.factors import Method
from plait.kfac.layers import (
    Approximation,
    FactorKind,
    FactorShape,
    KFACLayer,
    LinearLayer,
    make_layer,
    register_layer_type,
    unregister_layer_type,
)
from plait.kfac.pipeline import FactorComm, FactorPipeline, FactorSync, PipelineConfig
from plait.kfac.placement import Assignment, Distribution, PlacementPolicy, assign, lpt
from plait.kfac.preconditioner import KFAC, check_model

__all__ = [
    "KFAC",
    "Approximation",
    "Assignment",
    "Distribution",
    "FactorComm",
    "FactorKind",
    "FactorPipeline",
    "FactorShape",
    "FactorSync",
    "KFACConfig",
    "KFACCosts",
    "KFACLayer",
    "LinearLayer",
    "Method",
    "PipelineConfig",
    "PlacementPolicy",
    "assign",
    "check_model",
    "lpt",
    "make_layer",
    "register_layer_type",
    "unregister_layer_type",
]
