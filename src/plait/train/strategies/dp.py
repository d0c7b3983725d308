"""Data-parallel training strategies: one per compressor (``ssgd``, ``acpsgd``, ...)."""

from __future__ import annotations

from typing import Any

from torch import nn

from plait.comm import Collective
from plait.comm.fusion import DDP_DEFAULT_BUCKET_MB
from plait.dp.api import compressor_of, data_parallel
from plait.dp.compress import compressor_class, compressor_names
from plait.train.strategy import Strategy, check_options, keyword_options, register_strategy

#: Options that go to DDP (through `data_parallel`) rather than to the compressor.
DDP_OPTIONS = (
    "bucket_cap_mb",
    "final_bucket_mb",
    "find_unused_parameters",
    "gradient_as_bucket_view",
)


def check_ddp_options(strategy: str, options: dict[str, Any]) -> None:
    """ValueError unless the DDP options in `options` have usable values."""
    for key in ("bucket_cap_mb", "final_bucket_mb"):
        value = options.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ValueError(
                f"strategy {strategy!r}: {key} must be a number of MiB >= 0, got {value!r}"
            )
    for key in ("find_unused_parameters", "gradient_as_bucket_view"):
        if key in options and not isinstance(options[key], bool):
            raise ValueError(
                f"strategy {strategy!r}: {key} must be true or false, got {options[key]!r}"
            )


def check_compressor(strategy: str, compression: str, options: dict[str, Any]) -> None:
    """Build (and release) the compressor once, so that its option values are checked
    now, in the process that parses the spec, rather than in every worker at wrap time."""
    cls = compressor_class(compression)
    try:
        cls(**options).close()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"strategy {strategy!r}: {exc}") from exc


class DataParallel(Strategy):
    """DDP with the compressor named by the strategy; its options go to the compressor."""

    def __init__(
        self, *, compression: str, bucket_cap_mb: float | None = None, **options: Any
    ) -> None:
        cls = compressor_class(compression)  # fail early on an unknown name
        check_options(compression, options, [*DDP_OPTIONS, *keyword_options(cls)])
        check_ddp_options(compression, {"bucket_cap_mb": bucket_cap_mb, **options})
        if cls.single_bucket and (bucket_cap_mb is not None or "final_bucket_mb" in options):
            raise ValueError(
                f"strategy {compression!r} runs in one DDP bucket (its hook cannot pair "
                "several buckets' collectives on gloo): bucket_cap_mb and final_bucket_mb "
                "do not apply to it"
            )
        check_compressor(
            compression, compression, {k: v for k, v in options.items() if k not in DDP_OPTIONS}
        )
        self.name = compression
        self.compression = compression
        self.bucket_cap_mb = DDP_DEFAULT_BUCKET_MB if bucket_cap_mb is None else bucket_cap_mb
        self.options = options
        self._model: nn.Module | None = None
        self._pending_state: dict[str, Any] | None = None

    def collectives(self) -> frozenset[Collective]:
        return super().collectives() | compressor_class(self.compression).collectives

    def wrap(self, model: nn.Module) -> nn.Module:
        ddp = data_parallel(
            model, self.compression, bucket_cap_mb=self.bucket_cap_mb, **self.options
        )
        self._model = ddp
        if self._pending_state is not None:
            self.load_state_dict(self._pending_state)
        return ddp

    @property
    def compressor(self) -> Any:
        return None if self._model is None else compressor_of(self._model)

    def state_dict(self) -> dict[str, Any]:
        comp = self.compressor
        return {} if comp is None else {"compressor": comp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        comp = self.compressor
        if comp is None:
            self._pending_state = state
            return
        comp.load_state_dict(state.get("compressor", {}))

    def close(self) -> None:
        comp = self.compressor
        if comp is not None:
            comp.close()

    def describe(self) -> str:
        opts = ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.name}:{opts}" if opts else self.name


def _factory(name: str) -> Any:
    def make(**options: Any) -> DataParallel:
        return DataParallel(compression=name, **options)

    return make


for _name in compressor_names():
    register_strategy(_name)(_factory(_name))
