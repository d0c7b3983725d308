"""Comparison of distributed runs with a single-process reference, shared by the
element-wise compressors' tests."""

from __future__ import annotations

from typing import Any

import torch

# fp32 arithmetic in another order over 6 SGD steps
TOL = {"rtol": 1e-4, "atol": 1e-5}


def check(results: list[dict[str, Any]], key: str, ref: dict[str, torch.Tensor]) -> None:
    """Every rank's parameters after run `key` match `ref` within `TOL`."""
    for res in results:
        for name, value in ref.items():
            torch.testing.assert_close(res[key][name], value, **TOL, msg=f"{key} {name}")


def check_resume(results: list[dict[str, Any]], key: str) -> None:
    """The run resumed from a mid-way checkpoint ends bit-identical to the uninterrupted one."""
    for res in results:
        for param, value in res[key].items():
            torch.testing.assert_close(res[f"{key}-resume"][param], value, rtol=0, atol=0)
