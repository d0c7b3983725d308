"""The mesh refuses to exist without a process group (the parity tests build real ones)."""

from __future__ import annotations

import pytest

from plait.parallel import Plan
from plait.parallel.mesh import AXES, ParallelMesh


def test_mesh_needs_a_process_group() -> None:
    assert AXES == ("pp", "dp", "tp")  # tensor innermost: consecutive ranks talk most
    with pytest.raises(ValueError, match="initialised process group"):
        ParallelMesh.build(Plan(tp=2))
