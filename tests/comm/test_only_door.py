"""`plait.comm` is the only door to torch.distributed's collectives in plait's code.

Traffic that bypasses it is not counted, traced, booked on a modelled link, nor turned into
a `CollectiveError` when a peer is lost. The scan reads every module's syntax tree, so a
call added anywhere else fails here, whether written ``dist.all_reduce(...)``,
``torch.distributed.barrier()`` or imported by name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch.distributed as dist

import plait

SRC = Path(plait.__file__).parent

#: Every collective and point-to-point call of torch.distributed's public API.
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_reduce_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)

#: Modules allowed to call them, and why (every module of ``plait/comm/``, the door, is).
ALLOWED = {
    # beneath plait.comm in the layers (comm imports it), so it cannot go through comm:
    # the trace is gathered once, after training, to write one file
    "trace.py": "gathers every rank's trace events to rank 0 when writing the trace",
}


def _aliases(tree: ast.Module) -> tuple[set[str], dict[str, str]]:
    """Names bound to torch.distributed, and collectives imported from it (local name ->
    collective)."""
    modules: set[str] = set()
    functions: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch.distributed" and a.asname:
                    modules.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch" and any(a.name == "distributed" for a in node.names):
                modules |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            if node.module == "torch.distributed":
                functions |= {
                    a.asname or a.name: a.name for a in node.names if a.name in COLLECTIVES
                }
    return modules, functions


def _is_torch_distributed(node: ast.expr, aliases: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in aliases
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "distributed"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def collective_calls(source: str) -> list[tuple[int, str]]:
    """(line, call) of every torch.distributed collective called in `source`."""
    tree = ast.parse(source)
    modules, functions = _aliases(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in COLLECTIVES:
            if _is_torch_distributed(f.value, modules):
                found.append((node.lineno, f.attr))
        elif isinstance(f, ast.Name) and f.id in functions:
            found.append((node.lineno, functions[f.id]))
    return found


def test_the_list_names_real_collectives() -> None:
    # a typo in the list would let that call through unseen
    missing = [n for n in COLLECTIVES if not hasattr(dist, n)]
    assert set(missing) <= {"all_gather_single", "reduce_scatter_single"}, missing


def test_the_scan_finds_each_spelling() -> None:
    source = (
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch import distributed as d2\n"
        "from torch.distributed import barrier as wait_all\n"
        "dist.all_reduce(t)\n"
        "torch.distributed.broadcast_object_list(x, src=0)\n"
        "d2.send(t, 1)\n"
        "wait_all()\n"
        "dist.get_rank()\n"  # not a collective
        "ops.all_reduce(t)\n"  # through the door
    )
    assert collective_calls(source) == [
        (5, "all_reduce"),
        (6, "broadcast_object_list"),
        (7, "send"),
        (8, "barrier"),
    ]


def test_collectives_only_through_comm() -> None:
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in ALLOWED or rel.startswith("comm/"):
            continue
        for line, call in collective_calls(path.read_text()):
            offenders.append(f"src/plait/{rel}:{line}: {call}")
    assert not offenders, (
        "call torch.distributed's collectives through plait.comm (counted, traced, "
        "failing as CollectiveError), or add the module to ALLOWED with the reason:\n"
        + "\n".join(offenders)
    )


def test_allowed_modules_exist() -> None:
    # a module moved or renamed must not leave a stale exception behind
    assert all((SRC / rel).exists() for rel in ALLOWED)
