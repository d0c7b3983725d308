"""The one workload registry: built-in names and user factories resolve to a `Workload`.

``get_workload(spec)`` takes a registered name (``mlp``), a module factory
(``pkg.module:factory``) or a file factory (``path/to/file.py:factory``). A factory is a
callable with no required arguments that returns a `Workload`. Resolution is cheap (no
data is loaded, no model is built), so the command line resolves every workload in the
parent process, before any cluster or worker exists, and a bad spec fails there with an
error naming the module, file or attribute.
"""

from __future__ import annotations

from plait.specs import import_target
from plait.workloads.base import Workload
from plait.workloads.builtin import BUILTIN

WORKLOADS: dict[str, Workload] = {w.name: w for w in BUILTIN}


def register(workload: Workload, *, replace: bool = False) -> Workload:
    """Add `workload` under its name (ValueError if taken, unless `replace`)."""
    if not isinstance(workload, Workload):
        raise ValueError(f"register takes a plait Workload, got {type(workload).__name__}")
    if workload.name in WORKLOADS and not replace:
        raise ValueError(f"a workload named {workload.name!r} is already registered")
    WORKLOADS[workload.name] = workload
    return workload


def is_factory_spec(spec: str) -> bool:
    """Whether `spec` names a factory (``module:attr`` or ``file.py:attr``), not a name."""
    return ":" in spec


def load_factory(spec: str) -> Workload:
    """Import ``module:factory`` or ``file.py:factory`` and call the factory."""
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not attr.isidentifier():
        raise ValueError(
            f"workload {spec!r}: a factory is written pkg.module:factory or path/to/file.py:factory"
        )
    module = import_target(target, what="workload factory")
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"workload factory {spec!r}: {target!r} has no attribute {attr!r}")
    if callable(factory) and not isinstance(factory, Workload):
        try:
            workload = factory()
        except Exception as e:
            raise ValueError(f"workload factory {spec!r} raised {type(e).__name__}: {e}") from e
    else:
        workload = factory
    if not isinstance(workload, Workload):
        raise ValueError(
            f"workload factory {spec!r} returned {type(workload).__name__}, not a "
            "plait.workloads.Workload"
        )
    return workload


def get_workload(spec: str | Workload) -> Workload:
    """The workload a name or factory spec names; ValueError naming the problem otherwise."""
    if isinstance(spec, Workload):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"workload must be a name or a factory path, got {spec!r}")
    if is_factory_spec(spec):
        return load_factory(spec)
    try:
        return WORKLOADS[spec]
    except KeyError:
        raise ValueError(
            f"unknown workload {spec!r}; choose from {', '.join(WORKLOADS)}, "
            "or give a factory as pkg.module:factory or path/to/file.py:factory"
        ) from None
