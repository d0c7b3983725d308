"""`data_parallel`: DistributedDataParallel with a plait compressor as its comm hook."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from plait.comm.fusion import (
    DDP_DEFAULT_BUCKET_MB,
    DDP_DEFAULT_FINAL_BUCKET_MB,
    ThresholdPlanner,
    ddp_bucket_caps_mb,
)
from plait.distributed import retain_group
from plait.dp.compress import AllReduce, Compressor, compressor_class
from plait.dp.local import METHODS as LOCAL_METHODS
from plait.dp.local import LocalUpdate, local_update
from plait.persist import from_plain, to_plain
from plait.specs import parse_spec

logger = logging.getLogger(__name__)

#: Key of the compressor's state in a `data_parallel` model's ``state_dict()``.
STATE_KEY = "plait_compressor"
_STATE_FORMAT = 1


#: A DDP communication hook: ``hook(state, bucket) -> Future`` of the averaged bucket.
CommHook = Callable[[Any, Any], torch.futures.Future[torch.Tensor]]


def make_compressor(
    compression: str | Compressor = "ssgd", *, group: Any = None, **options: Any
) -> Compressor:
    """The compressor named by `compression`, built with `options`; no process group needed.

    Args:
        compression: a name (``"acpsgd"``), a spec with options (``"acpsgd:rank=4"``) or an
            instance (returned as is; `options` must then be empty).
        group: process group the compressor communicates in (None: the default group).
        **options: compressor options; an option may not be given in the spec too.

    Raises:
        ValueError: unknown compressor, unknown or invalid option, or an option given twice.
    """
    if isinstance(compression, Compressor):
        if options:
            raise ValueError("pass options to the compressor itself when giving an instance")
        return compression
    if not isinstance(compression, str):
        raise ValueError(
            f"compression must be a compressor name, spec or instance, got {compression!r}"
        )
    name, spec_options = parse_spec(compression)
    twice = sorted(spec_options.keys() & options.keys())
    if twice:
        raise ValueError(f"option(s) {twice} given both in {compression!r} and as keywords")
    cls = compressor_class(name)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "group")]
    unknown = sorted((spec_options.keys() | options.keys()) - set(accepted))
    if unknown:
        raise ValueError(
            f"compressor {name!r} has no option {unknown[0]!r} (accepted: "
            f"{', '.join(accepted) or 'none'})"
        )
    try:
        return cls(group=group, **spec_options, **options)
    except TypeError as exc:
        raise ValueError(
            f"invalid options for compressor {compression!r}: {exc} (accepted: "
            f"{', '.join(accepted) or 'none'})"
        ) from None


def comm_hook(
    compression: str | Compressor = "ssgd", *, group: Any = None, **options: Any
) -> tuple[Compressor, CommHook]:
    """A compressor as the ``(state, hook)`` pair of a DDP communication hook.

    For DDP wrappers plait does not build itself (PyTorch Lightning's
    ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook)``, Hugging Face accelerate's
    prepared model, a hand-made DDP): ``ddp.register_comm_hook(state, hook)`` makes that
    DDP average its gradients with plait's compressor. It needs no process group yet, so
    it can be called before the framework initialises one.

    Compared with `data_parallel`, the framework decides DDP's buckets (plait's planner is
    not consulted) and its checkpoints do not hold the compressor's state: save
    ``state.state_dict()`` and restore it with ``state.load_state_dict()`` for an exact
    resume. Parameters are then known by their order (``param0``, ...), not their names.
    A compressor that needs a single bucket (``torch-powersgd``) needs the framework's
    ``bucket_cap_mb`` above the model's gradient size, or its hook stops with a ValueError.

    Low-rank compressors (``acpsgd``, ``powersgd``) need a rank the model tolerates: too
    low a rank under an adaptive optimizer stalls training without any error (GPT-2 under
    AdamW with ``acpsgd:rank=4``: loss 4.04 against 1.72 uncompressed after 32 steps).
    Compare a short run against ``"ssgd"`` before a long one, and raise ``rank`` (or keep
    ``warmup`` dense steps) when the compressed loss lags.

    Args:
        compression: as in `make_compressor`.
        group: process group (None: the default group of the DDP that registers it).
        **options: compressor options.

    Returns:
        The compressor (DDP's hook state) and its hook.

    Raises:
        ValueError: as `make_compressor`.
    """
    comp = make_compressor(compression, group=group, **options)
    return comp, type(comp).hook


def data_parallel(
    model: nn.Module,
    compression: str | Compressor = "ssgd",
    /,
    *,
    bucket_cap_mb: float = DDP_DEFAULT_BUCKET_MB,
    final_bucket_mb: float = DDP_DEFAULT_FINAL_BUCKET_MB,
    group: Any = None,
    find_unused_parameters: bool = False,
    gradient_as_bucket_view: bool = True,
    **options: Any,
) -> DistributedDataParallel | LocalUpdate:
    """Wrap `model` in DDP and register the named compressor as its comm hook, or, for a
    local-update method (``"diloco"``, ``"localsgd"``), in `plait.dp.local.LocalUpdate`.

    The gradient buckets are planned by `plait.comm`'s fusion planner on the bytes each
    parameter actually sends, with a threshold of `bucket_cap_mb` scaled by the
    compressor's compression ratio, so a compressed model has as many buckets (and as much
    overlap with backward) as uncompressed S-SGD. Gradients are views into DDP's buckets by
    default, which spares two copies of the whole gradient per step.

    Checkpoints: the returned model's ``state_dict()`` holds, next to the parameters, the
    compressor's state (error-feedback buffers, low-rank factors, step counters) of the
    rank that calls it, under the key ``"plait_compressor"`` (a dict of plain tensors,
    numbers and strings, loadable with ``torch.load(weights_only=True)``), and
    ``load_state_dict()`` restores it. Saving and loading the wrapped model, as with any
    DDP model, therefore resumes the compressor too, with no extra call::

        torch.save(ddp.state_dict(), f"ckpt-rank{rank}.pt")      # every rank: exact
        ddp.load_state_dict(torch.load(f"ckpt-rank{rank}.pt", weights_only=True))

    Error-feedback buffers differ between ranks: for a bit-exact resume every rank saves
    its own file as above. A file saved by rank 0 only and loaded everywhere also works
    (its step counters and shared factors are right); the other ranks then start from rank
    0's residuals, which is logged as a warning. The state of ``ddp.module.state_dict()``
    (the bare model) has no compressor state. `compressor_of` gives the compressor itself.

    Local-update methods (``data_parallel(model, "diloco", inner_steps=50)``) take
    `plait.dp.local.LocalConfig`'s fields as options (``fragments``, ``delay``,
    ``compression``, ...) and ignore the DDP bucket options; the loop stays as it is (the
    outer step runs inside ``optimizer.step()``). Their ``state_dict()`` holds the outer
    state under ``"plait_local"``; save it, and the inner optimizer's, on every rank.

    Args:
        model: the module to train; its parameters must live on one device.
        compression: a compressor name (``"ssgd"``, ``"acpsgd"``, ...), a spec with its
            options (``"acpsgd:rank=4"``, as on the command line) or an instance; given
            by position, so that a keyword ``compression`` can be a local-update
            method's option (``data_parallel(m, "diloco", compression="int4")``).
        bucket_cap_mb: fusion threshold of the uncompressed gradient, in MiB.
        final_bucket_mb: the gradients ready last form a bucket of about this size (MiB,
            uncompressed; 0 for none), which shortens the communication left after backward.
        group: process group (None: the default group).
        find_unused_parameters: as in DDP; needed when some parameters get no gradient.
        gradient_as_bucket_view: as in DDP.
        **options: compressor options (``rank=4``, ...).

    Raises:
        ValueError: unknown compressor, bad options, no process group, or a model DDP
            cannot wrap (no trainable parameters, parameters on several devices, sparse
            gradients with a compressor that needs dense ones).
    """
    if not dist.is_initialized():
        raise ValueError("data_parallel needs an initialised process group (run under torchrun)")
    if isinstance(compression, str):
        method, spec_options = parse_spec(compression)
        if method in LOCAL_METHODS:
            twice = sorted(spec_options.keys() & options.keys())
            if twice:
                raise ValueError(f"option(s) {twice} given both in {compression!r} and as keywords")
            merged: dict[str, Any] = {**spec_options, **options}
            return local_update(model, method, group=group, **merged)
    if not isinstance(model, nn.Module):
        raise ValueError(f"data_parallel expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, DistributedDataParallel):
        raise ValueError("model is already wrapped in DistributedDataParallel")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    if not params:
        raise ValueError(f"{type(model).__name__} has no trainable parameters to synchronise")
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"DDP needs all parameters on one device, found {sorted(map(str, devices))}"
        )
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    if final_bucket_mb < 0:
        raise ValueError(f"final_bucket_mb must be >= 0, got {final_bucket_mb}")
    comp = make_compressor(compression, group=group, **options)
    if not isinstance(comp, AllReduce):
        sparse = [
            name
            for name, mod in model.named_modules()
            if isinstance(mod, nn.Embedding | nn.EmbeddingBag) and mod.sparse
        ]
        if sparse:
            raise ValueError(
                f"compressor {comp.name!r} needs dense gradients, but {sparse[0]!r} is an "
                "embedding with sparse=True"
            )
    # DDP fills buckets in reverse parameter order, about the order gradients become ready
    ready = list(reversed(named))
    sizes = [p.numel() * p.element_size() for _, p in ready]
    if comp.single_bucket:
        caps = [sum(sizes) / 2**20]
    else:
        ratio = comp.compression_ratio(model)
        planner = ThresholdPlanner(
            threshold_bytes=int(bucket_cap_mb * 2**20), final_bytes=int(final_bucket_mb * 2**20)
        ).scaled(ratio)
        wire = [comp.payload_nbytes(n, p) for n, p in ready]
        caps = ddp_bucket_caps_mb(planner, sizes, wire_sizes=wire)
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        bucket_cap_mb_list=caps,  # type: ignore[arg-type]  # DDP accepts fractional MiB
        find_unused_parameters=find_unused_parameters,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    retain_group(ddp.process_group)  # no gloo join under the GIL at exit: `retain_group`
    comp.register(ddp)
    ddp.plait_compressor = comp  # type: ignore[assignment]
    ddp.register_state_dict_post_hook(_save_compressor_state)
    ddp.register_load_state_dict_pre_hook(_load_compressor_state)
    return ddp


def _save_compressor_state(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """State-dict hook: add this rank's compressor state under `STATE_KEY`."""
    comp = compressor_of(module)
    if comp is None:
        return
    state_dict[prefix + STATE_KEY] = {
        "format": _STATE_FORMAT,
        "compressor": comp.name,
        "rank": dist.get_rank(comp.group) if dist.is_initialized() else 0,
        "world_size": dist.get_world_size(comp.group) if dist.is_initialized() else 1,
        "state": to_plain(comp.state_dict(), f"{comp.name} state"),
    }


def _load_compressor_state(  # noqa: PLR0917 - torch calls load pre-hooks positionally
    module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook: take `STATE_KEY` out (DDP would call it unexpected) and
    restore the compressor from it. A state dict without it leaves the compressor as is."""
    saved = state_dict.pop(prefix + STATE_KEY, None)
    comp = compressor_of(module)
    if saved is None or comp is None:
        return
    if not isinstance(saved, Mapping) or saved.get("format") != _STATE_FORMAT:
        error_msgs.append(f"{prefix + STATE_KEY} is not a plait compressor state")
        return
    if saved.get("compressor") != comp.name:
        error_msgs.append(
            f"{prefix + STATE_KEY} holds the state of compressor {saved.get('compressor')!r}, "
            f"this model uses {comp.name!r}"
        )
        return
    rank = dist.get_rank(comp.group) if dist.is_initialized() else 0
    world = dist.get_world_size(comp.group) if dist.is_initialized() else 1
    if (saved.get("rank"), saved.get("world_size")) != (rank, world):
        logger.warning(
            "compressor state saved by rank %s of %s is loaded on rank %d of %d: its "
            "error-feedback residuals are that rank's (save every rank's state_dict for an "
            "exact resume)",
            saved.get("rank"),
            saved.get("world_size"),
            rank,
            world,
        )
    try:
        comp.load_state_dict(from_plain(saved["state"]))
    except (ValueError, KeyError, TypeError) as exc:
        error_msgs.append(f"cannot restore compressor {comp.name!r}: {exc}")


def compressor_of(model: nn.Module) -> Compressor | None:
    """The compressor `data_parallel` attached to `model`, if any."""
    comp = getattr(model, "plait_compressor", None)
    return comp if isinstance(comp, Compressor) else None
