"""Which adapter a model gets: its class's registered one, one derived from its
structure, or the fallback (data parallelism and ZeRO only).

Above both `plait.parallel.adapters` (the interface and the registry) and
`plait.parallel.derive` (adapters read from a model's structure, built on that
interface), so that neither imports the other back.
"""

from __future__ import annotations

from torch import nn

from plait.parallel.adapters import ModelAdapter, SequentialAdapter, registered_adapter
from plait.parallel.derive import derived_adapter


def adapter_for(model: nn.Module) -> ModelAdapter:
    """The adapter registered for the most specific class of `model`.

    A model of no registered class gets a plan derived from its structure
    (`plait.parallel.derive`) when it has a stack of repeated blocks, and otherwise the
    fallback adapter (data parallelism and ZeRO only).
    """
    adapter = registered_adapter(model)
    if adapter is not None:
        # a chain of repeated blocks (an MLP of residual blocks) shards them by tensor
        if type(adapter) is SequentialAdapter and not adapter._layers(model):
            derived = derived_adapter(model)
            if derived is not None and derived.dims(model).layers:
                return derived
        return adapter
    return derived_adapter(model) or ModelAdapter()
