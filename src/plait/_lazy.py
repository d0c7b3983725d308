"""Package attributes imported on first use (PEP 562).

`plait`, `plait.parallel` and `plait.train` export names whose modules import torch (and
`plait.fused` torch._dynamo). Importing them eagerly cost ``import plait`` 2.4 s and
``plait --help`` 2.5 s, so each package resolves them in its ``__getattr__`` instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for `package`: each of `names` (attribute -> the module that
    defines it) imported when first asked for; anything else an AttributeError."""

    def attribute(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(names[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return attribute
