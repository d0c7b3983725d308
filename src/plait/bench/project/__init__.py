"""Projection of step time and time to target to clusters this host cannot hold.

This host emulates 2-4 nodes; the papers ran 8-64 GPUs on 1-100 Gb/s links. The projection
carries what is measured here to those sizes with the alpha-beta model:

- a `Profile` of the workload, measured on one process of a device (`measure_profile`):
  forward, backward and optimizer time, each gradient's ready time within backward, each
  strategy's own computation per step (a step without peers minus its compute-only step:
  compression, K-FAC's factors), the seconds of each K-FAC factor's decomposition;
- the bytes of every collective of a step, from the same code that plans them in a job:
  DDP's buckets (`plait.comm.fusion`, with the compressor's payload sizes), K-FAC's factor
  buckets and the placement of its inversions (`plait.kfac.placement`);
- a link: the alpha-beta model of a rate (`plait.comm.link.link_model`), priced with the
  backend's algorithms (gloo's on the emulated cluster, the ring algorithms NCCL uses on a
  GPU cluster).

`project` simulates one step of a strategy on `world` workers: forward, then backward
releasing gradient buckets at their ready times onto one wire per worker (each transfer
starts when it is issued and the wire is free, so communication overlaps the backward pass
as it does in DDP), compression on the compute path before its bucket leaves (it competes
with backward for the device; Power-SGD's two all-reduces one after the other), K-FAC's
factor all-reduces after backward (``kfac-naive``), in threshold buckets (``kfac-static``)
or ready-time buckets (``spd-kfac``) sharing that wire, the inversions of the slowest
worker once their factors landed, the broadcast of their results, and the preconditioning
and optimizer step. `cluster_map` and `recommend` multiply a step by the steps to a target
measured in the races (``benchmarks/race``).

Compute measured on one process is the compute of a node with that device to itself. On
the emulated cluster the nodes share two cores, so `validate` scales the profile's compute
by the ratio of each measured compute-only step to the profile's (the nodes' contention,
measured in the same run), and checks the predicted step against the measured one.

Modules: `profile` (measuring), `step` (the simulation), `advice` (validation, time to
target, the map, `recommend`); ``python -m plait.bench.project`` runs them.
"""

from __future__ import annotations

from plait.bench.project.advice import (
    DEFAULT_CANDIDATES,
    TOLERANCE,
    Candidate,
    Cell,
    Check,
    Recommendation,
    checks_markdown,
    cluster_map,
    host_cost,
    map_markdown,
    plot_map,
    race_candidates,
    recommend,
    validate,
)
from plait.bench.project.profile import Grad, Profile, StrategyCost, measure_profile
from plait.bench.project.step import (
    AUTO_INTERVAL,
    KFAC_PRESETS,
    StepEstimate,
    profile_key,
    project,
    projectable,
)

__all__ = [
    "AUTO_INTERVAL",
    "DEFAULT_CANDIDATES",
    "KFAC_PRESETS",
    "TOLERANCE",
    "Candidate",
    "Cell",
    "Check",
    "Grad",
    "Profile",
    "Recommendation",
    "StepEstimate",
    "StrategyCost",
    "checks_markdown",
    "cluster_map",
    "host_cost",
    "map_markdown",
    "measure_profile",
    "plot_map",
    "profile_key",
    "project",
    "projectable",
    "race_candidates",
    "recommend",
    "validate",
]
