"""Distributed K-FAC with SPD-KFAC's pipelined factor communication and balanced inversion,
and the eigenbasis methods on the same machinery (EKFAC, SOAP-style Adam)."""

from __future__ import annotations

from plait.kfac.capture import FactorCapture
from plait.kfac.config import KFACConfig
from plait.kfac.costs import KFACCosts
from plait.kfac.eigenbasis import Graft, Mode
from plait.kfac.factors import Method
from plait.kfac.groups import ProcessGroups
from plait.kfac.intervals import (
    AutoIntervals,
    FixedIntervals,
    IntervalController,
    Intervals,
    StepPlan,
    StepSample,
)
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
from plait.kfac.placement import (
    Assignment,
    Distribution,
    PlacementPolicy,
    PlacementProvider,
    assign,
    lpt,
)
from plait.kfac.preconditioner import KFAC, check_model

__all__ = [
    "KFAC",
    "Approximation",
    "Assignment",
    "AutoIntervals",
    "Distribution",
    "FactorCapture",
    "FactorComm",
    "FactorKind",
    "FactorPipeline",
    "FactorShape",
    "FactorSync",
    "FixedIntervals",
    "Graft",
    "IntervalController",
    "Intervals",
    "KFACConfig",
    "KFACCosts",
    "KFACLayer",
    "LinearLayer",
    "Method",
    "Mode",
    "PipelineConfig",
    "PlacementPolicy",
    "PlacementProvider",
    "ProcessGroups",
    "StepPlan",
    "StepSample",
    "assign",
    "check_model",
    "lpt",
    "make_layer",
    "register_layer_type",
    "unregister_layer_type",
]
