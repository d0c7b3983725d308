"""The device mesh of a plan: ranks laid out as pipeline x data x tensor.

Tensor parallelism talks most (several collectives per block), so its axis is innermost:
consecutive ranks, the same node when a node runs several processes. The pipeline axis,
which sends one activation per micro-batch, is outermost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from plait.distributed import mesh_backend_options
from plait.parallel.plan import Plan

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class ParallelMesh:
    """The 3-D mesh of a resolved plan and this rank's coordinates on it."""

    mesh: DeviceMesh
    plan: Plan

    @classmethod
    def build(cls, plan: Plan, *, device: torch.device | None = None) -> ParallelMesh:
        """Collective: every rank builds the same mesh (one process group per axis slice)."""
        if not dist.is_initialized():
            raise ValueError(
                "plait.parallel needs an initialised process group (run under torchrun)"
            )
        world = dist.get_world_size()
        plan = plan.validate(world=world)
        dev = device or torch.device("cpu")
        shape = (plan.pp, plan.data_degree(world), plan.tp)
        # every axis group carries plait's timeout, not torch's 30-minute default
        mesh = init_device_mesh(
            dev.type, shape, mesh_dim_names=AXES, backend_override=mesh_backend_options(len(AXES))
        )
        return cls(mesh=mesh, plan=plan)

    def sub(self, axis: str) -> DeviceMesh:
        return self.mesh[axis]

    def group(self, axis: str) -> Any:
        return self.mesh.get_group(axis)

    def size(self, axis: str) -> int:
        return int(self.mesh.size(AXES.index(axis)))

    def rank(self, axis: str) -> int:
        return int(self.mesh.get_local_rank(axis))

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.rank("dp")
