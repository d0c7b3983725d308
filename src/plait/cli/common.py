"""What the commands share: the parser class, the cluster flags, argument types and the
checks that run before anything is built."""

from __future__ import annotations

import argparse
import math
import os
import re
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

from plait.cluster.network import NAMED_RATES, NetworkSpec, parse_duration, resolve_bandwidth
from plait.flags import add_options, build, option
from plait.log import check_tensorboard
from plait.units import parse_size

#: Emulated nodes when ``--nodes`` is not given, the same in every command: the size of the
#: cluster the demo and the committed benchmarks use.
DEFAULT_NODES = 4


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each flag's default, unless it has none or its help already says.

    Defaults of None (decided later, e.g. "the workload's") and of on/off switches say
    nothing a reader needs; tuples print as they are typed (``1,2,4``).
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text
            or default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
        ):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, tuple | list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class ListingFormatter(_Formatter, argparse.RawDescriptionHelpFormatter):
    """`Parser`'s help, with the description and the epilog printed line by line as
    written: an epilog that lists things (``plait bench``'s suites) keeps one per line."""


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line: the flag, the bad value, what it takes.

    Every parser and subparser it makes shows the flags' defaults in ``--help``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        # a value starting with a dash and a digit is a value (`--latency -5ms` reaches its
        # check, which says what is wrong), not an unknown flag ("expected one argument")
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bandwidth_help(*, multi: bool) -> str:
    """``--bandwidth``'s help: the named rates, and whether a list of rates runs each."""
    text = (
        f"egress rate per node: a tc rate from 1kbit to 1tbit (100mbit, 1gbit; bps is bytes/s, "
        f"as in tc) or a named setting "
        f"({', '.join(f'{k}={v}' for k, v in NAMED_RATES.items())})"
    )
    if multi:
        text += "; a comma-separated list runs each"
    return text + " (default: unshaped)"


#: The argument group of ``--help`` that holds the emulated cluster's flags.
CLUSTER_GROUP = "emulated cluster"


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The emulated cluster a command runs on: the schema of its flags (`plait.flags`).

    Every command that builds a cluster takes the same flags with the same checks, so
    they are declared once; a command's config holds one (``nested(ClusterConfig)``).
    The constructor checks the values (ValueError naming the flag) and normalises
    ``bandwidth`` and ``latency`` to what tc reads. Where the ranks compute (``device``)
    is checked against this machine by `placement`, not here: a config may describe a
    cluster of another machine.

    Attributes:
        nodes: emulated nodes (network namespaces).
        nproc_per_node: worker processes per node.
        bandwidth: egress rate per node (a tc rate or a named one), None for unshaped.
        latency: added one-way delay per link (``2ms``), None for none.
        loss: packet loss per link in percent, None for none.
        threads: intra-op threads per worker process.
        timeout: wall-clock limit in seconds, None for none.
        device: where the ranks compute (``auto``: cuda if present).
        link: how the links are shaped: tc on network namespaces, or an alpha-beta model.
    """

    #: Whether ``--bandwidth`` takes a comma-separated list of rates, one run each.
    MULTI_BANDWIDTH: ClassVar[bool] = False

    nodes: int = option(DEFAULT_NODES, "emulated nodes (network namespaces)")
    nproc_per_node: int = option(1, "worker processes per node")
    bandwidth: str | None = option(None, _bandwidth_help(multi=False))
    latency: str | None = option(
        None, "added one-way delay per link, up to 60s, e.g. 2ms (default: none)"
    )
    loss: float | None = option(None, "packet loss per link, percent in [0, 100) (default: none)")
    threads: int = option(1, "intra-op threads per worker process")
    timeout: float | None = option(None, "wall-clock limit in seconds (default: none)")
    device: Literal["auto", "cpu", "cuda"] = option(
        "auto",
        "where the ranks compute: cuda puts every rank on this host's GPUs (ranks "
        "sharing a GPU talk through gloo, a GPU each through NCCL); auto: cuda if present",
    )
    link: Literal["auto", "tc", "model"] = option(
        "auto",
        "how --bandwidth/--latency shape the links: tc on network namespaces (root, "
        "not gVisor), model: plait's collectives take an alpha-beta model's time on "
        "loopback; auto: tc where it works, else model",
    )

    def __post_init__(self) -> None:
        int_at_least("--nodes", self.nodes, 1, MAX_NODES)
        int_at_least("--nproc-per-node", self.nproc_per_node, 1)
        int_at_least("--threads", self.threads, 1)
        check_number("--timeout", self.timeout, low=0, low_open=True)
        bandwidth = _bandwidths(self.bandwidth, multi=self.MULTI_BANDWIDTH)
        object.__setattr__(self, "bandwidth", bandwidth)
        if self.latency is not None:
            try:
                parse_duration(self.latency)
            except ValueError as exc:
                raise ValueError(f"--latency: {exc}") from None
            object.__setattr__(self, "latency", self.latency.strip().lower())
        check_number("--loss", self.loss, low=0, high=100, high_open=True)
        if self.link == "model" and self.loss:
            raise ValueError(
                f"--loss {self.loss} with --link model: a modelled link loses no packets"
            )

    @property
    def world(self) -> int:
        """Ranks in the cluster: nodes times processes per node."""
        return self.nodes * self.nproc_per_node

    def bandwidths(self) -> list[str | None]:
        """The rates to run at, one run each (``[None]``: one unshaped run)."""
        return [b.strip() for b in self.bandwidth.split(",")] if self.bandwidth else [None]

    def network(self, bandwidth: str | None = None) -> NetworkSpec:
        """The network at `bandwidth` (default: ``bandwidth``) with this latency and loss."""
        return NetworkSpec(
            bandwidth=bandwidth if bandwidth is not None else self.bandwidth,
            latency=self.latency,
            loss=self.loss,
        )

    def placement(self) -> Any:
        """Where rank 0 computes on this host and the ranks' backend
        (`plait.distributed.gpu_placement`); ValueError for ``cuda`` without a GPU."""
        return _placement(self.device, self.world)


@dataclass(frozen=True, kw_only=True)
class MultiRateClusterConfig(ClusterConfig):
    """`ClusterConfig` whose ``--bandwidth`` may list rates, the command running at each
    (``plait bench``, ``plait crossover run``)."""

    MULTI_BANDWIDTH: ClassVar[bool] = True

    bandwidth: str | None = option(None, _bandwidth_help(multi=True))


def add_cluster_args(p: argparse.ArgumentParser, *, multi_bandwidth: bool = False) -> None:
    """The emulated cluster's flags in their own group (a command without a config)."""
    config = MultiRateClusterConfig if multi_bandwidth else ClusterConfig
    add_options(p.add_argument_group(CLUSTER_GROUP), config)


def add_config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="TOML",
        help="read this command's flags from a TOML run config: its keys are the flag names "
        "(dashes or underscores); flags given on the command line override it",
    )


def version_text() -> str:
    """plait's and torch's versions, from their installed metadata: every parse builds
    this text, and importing torch for it would cost ``plait --help`` 1.3 s."""
    from importlib import metadata

    from plait import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"plait {__version__} (torch {torch_version})"


def add_verbosity_flags(parser: argparse.ArgumentParser, *, default: object) -> None:
    g = parser.add_mutually_exclusive_group()
    g.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default,
        help="also log debugging detail, each line naming its logger",
    )
    g.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="log warnings and errors only, and draw no progress bar",
    )


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Accept ``--debug``, ``--verbose`` and ``--quiet`` after any subcommand too
    (``plait train ... --debug``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                if not any("--debug" in a.option_strings for a in child._actions):
                    child.add_argument(
                        "--debug",
                        action="store_true",
                        default=argparse.SUPPRESS,
                        help="show the traceback of an error",
                    )
                if not any("--verbose" in a.option_strings for a in child._actions):
                    add_verbosity_flags(child, default=argparse.SUPPRESS)
                add_debug_flag(child)


def floats_arg(text: str) -> tuple[float, ...]:
    """Comma-separated finite numbers (``1e-3,1.0``)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers (e.g. 1e-3,1.0)"
        ) from None
    if not values or not all(math.isfinite(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: expected finite numbers, e.g. 1e-3,1.0")
    return values


def ints_arg(text: str) -> tuple[int, ...]:
    """Comma-separated integers (``1,2,4``)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 1,2,4)"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: expected at least one integer, e.g. 1,2,4")
    return values


def size_arg(text: str) -> int:
    """A size (``512MiB``, ``2GB`` = 2*10^9, ``2GiB`` = 2*2^30, or bytes): `plait.units`."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def trace_path(trace: str | None, bandwidth: str | None) -> Path | None:
    """One trace per network setting when several run: ``t.json`` -> ``t_slow.json``."""
    if trace is None:
        return None
    path = Path(trace)
    return path if bandwidth is None else path.with_name(f"{path.stem}_{bandwidth}{path.suffix}")


def command_line() -> str:
    return " ".join(["plait", *sys.argv[1:]])


#: Largest emulated cluster (one /24 of veth addresses, see `plait.cluster.netns`).
MAX_NODES = 250


_GROUP_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


MODULE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def int_at_least(flag: str, value: int | None, minimum: int, maximum: int | None = None) -> None:
    """ValueError naming `flag` unless `value` (when given) is in [minimum, maximum]."""
    if value is None:
        return
    if value < minimum or (maximum is not None and value > maximum):
        accepted = (
            f"an integer >= {minimum}"
            if maximum is None
            else (f"an integer from {minimum} to {maximum}")
        )
        raise ValueError(f"{flag} {value}: expected {accepted}")


def check_number(
    flag: str,
    value: float | None,
    *,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """ValueError naming `flag` unless `value` (when given) is finite and in range."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and (value < high if high_open else value <= high)
    if not ok:
        lo = f"{'(' if low_open else '['}{low:g}"
        hi = f"{high:g}{')' if high_open else ']'}" if high is not None else "inf)"
        raise ValueError(f"{flag} {value}: expected a number in {lo}, {hi}")


def _creatable(flag: str, path: str, p: Path) -> None:
    """The nearest existing ancestor of `p` is a directory this process can create in.

    Tried, not inferred from permission bits: root passes every ``access`` check, yet
    cannot create a file in /proc or on a read-only mount (``--out /proc/plait.json``
    used to train to the end and then lose the metrics).
    """
    anc = p.parent
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: cannot be created, {str(anc)!r} is not writable")
    probe = anc / f".plait-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError as exc:
        raise ValueError(
            f"{flag} {path!r}: cannot be created in {str(anc)!r} ({exc.strerror})"
        ) from None
    os.unlink(probe)


def writable_dir(flag: str, path: str | None) -> None:
    """`path` is a writable directory, or one that can be created."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{flag}: empty path; expected a directory")
    p = Path(path).expanduser()
    if p.exists():
        if not p.is_dir():
            raise ValueError(f"{flag} {path!r}: exists and is not a directory")
        if not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path!r}: directory is not writable")
        return
    _creatable(flag, path, p)


def writable_file(flag: str, path: str | None) -> None:
    """`path` names a file that can be written (created with its parents if need be)."""
    if path is None:
        return
    if not str(path).strip():
        raise ValueError(f"{flag}: empty path; expected a file")
    p = Path(path).expanduser()
    if p.is_dir():
        raise ValueError(f"{flag} {path!r}: is a directory; expected a file path")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{flag} {path!r}: file is not writable")
        return
    _creatable(flag, path, p)


#: Bounds of every number a command takes, by its destination: (lowest, highest), both
#: included. One table for all commands, checked before any command-specific check, so a
#: flag means the same range wherever it appears and an absurd value (``--steps 1e23``,
#: ``--threads 1000000``, ``--lr 1e308``) fails in one line instead of later, in a worker.
#: Counts of steps stop at ten million (a day at 120 steps/s), processes at what one
#: emulated machine can hold, seeds at what torch's generator takes.
NUMBER_BOUNDS: dict[str, tuple[float, float]] = {
    "nproc_per_node": (1, 256),
    "threads": (1, 1024),
    "timeout": (1, 365 * 86400),
    "steps": (1, 10**7),
    "epochs": (1, 10**6),
    "max_steps": (1, 10**7),
    "warmup": (0, 10**7),
    "eval_every": (0, 10**7),
    "checkpoint_every": (0, 10**7),
    "chunk": (1, 10**7),
    "repeats": (1, 10**4),
    "rounds": (1, 10**4),
    "batch_size": (1, 10**7),
    "accumulate": (1, 10**4),
    "max_restarts": (0, 100),
    "trials": (1, 10**6),
    "max_models": (1, 4096),
    "n": (1, 4096),
    "slots": (1, 4096),
    "seed": (0, 2**63 - 1),
    "seeds": (0, 2**63 - 1),
    "lr": (1e-12, 1e3),
    "momentum": (0, 1),
    "weight_decay": (0, 1e3),
}


def check_numbers(args: argparse.Namespace) -> None:
    """Every number in `args` within `NUMBER_BOUNDS` (lists element by element)."""
    for dest, (low, high) in NUMBER_BOUNDS.items():
        value = getattr(args, dest, None)
        values = value if isinstance(value, tuple | list) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int | float):
                continue  # not given, or text checked elsewhere (race's --lr LABEL=LR)
            if not (math.isfinite(v) and low <= v <= high):
                flag = f"--{dest.replace('_', '-')}"
                kind = "an integer" if isinstance(v, int) else "a number"
                raise ValueError(
                    f"{flag} {v}: expected {kind} from {_bound(low)} to {_bound(high)}"
                )


def _bound(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _bandwidths(text: str | None, *, multi: bool) -> str | None:
    """Check ``--bandwidth`` (a list when `multi`) and return it as tc reads it."""
    if text is None:
        return None
    items = [b.strip().lower() for b in text.split(",")] if multi else [text.strip().lower()]
    for b in items:
        if not b:
            raise ValueError(f"--bandwidth {text!r}: empty item; expected e.g. slow,fast")
        try:
            resolve_bandwidth(b)
        except ValueError as exc:
            raise ValueError(f"--bandwidth: {exc}") from None
    return ",".join(items)


def check_cluster_args(args: argparse.Namespace) -> None:
    """The emulated cluster's flags (`ClusterConfig`) of a command without a config of its
    own (``plait train``); normalises --bandwidth and --latency for tc and records where
    the ranks compute (``args.placement``)."""
    cluster = build(args, ClusterConfig)
    args.bandwidth, args.latency = cluster.bandwidth, cluster.latency
    args.placement = cluster.placement()


def _placement(device: str, ranks: int) -> Any:
    """Where rank 0 of `ranks` on this host computes and which backend they use
    (`plait.distributed.gpu_placement`); ``cuda`` without a GPU is refused here."""
    import torch

    from plait.distributed import gpu_placement

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    kind = ("cuda" if gpus else "cpu") if device == "auto" else device
    if kind == "cuda" and not gpus:
        raise ValueError("--device cuda: this machine has no CUDA device")
    return gpu_placement(kind, host_ranks=ranks, host_index=0, gpus=gpus)


def check_backend(strategy: Any, args: argparse.Namespace) -> None:
    """Refuse a strategy whose collectives the job's backend cannot run on its device."""
    from plait.comm import check_collectives

    place = getattr(args, "placement", None)
    if place is not None:
        check_collectives(
            f"strategy {strategy.describe()!r}",
            strategy.collectives(),
            backend=place.backend,
            device=place.device,
        )


def export_cluster_env(args: argparse.Namespace) -> None:
    """Hand ``--device`` and ``--link`` to everything this command launches (the workers
    read PLAIT_DEVICE, `Cluster.create` reads PLAIT_LINK) and say how ranks share GPUs."""
    from plait.cluster.netns import LINK_ENV
    from plait.distributed import DEVICE_ENV

    place = args.placement
    os.environ[DEVICE_ENV] = "cuda" if place.device.startswith("cuda") else "cpu"
    os.environ[LINK_ENV] = args.link
    if place.shared:
        ranks = args.nodes * args.nproc_per_node
        print(
            f"plait {args.command}: {ranks} ranks share this host's GPU(s); their collectives "
            "go through gloo (CUDA tensors by way of pinned host memory)",
            flush=True,
        )


def check_tensorboard_dir(log_dir: str | None) -> None:
    """``--tensorboard DIR``: a writable directory, and TensorBoard installed."""
    if log_dir is None:
        return
    writable_dir("--tensorboard", log_dir)
    check_tensorboard(log_dir)


def check_group(flag: str, group: str | None) -> None:
    if group is not None and (not _GROUP_RE.fullmatch(group) or group in (".", "..")):
        raise ValueError(
            f"{flag} {group!r}: expected 1-64 letters, digits, '_', '.' or '-' (not . or ..)"
        )


def check_token_dir(flag: str) -> None:
    """The compute token's folder is this user's own, checked here rather than in every
    worker after the namespaces exist (another user's folder, a link)."""
    from plait.crossover.token import token_dir

    try:
        token_dir()
    except PermissionError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def check_device(flag: str, device: str) -> None:
    """``cpu`` or ``cuda[:N]`` with such a GPU present."""
    m = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not m:
        raise ValueError(f"{flag} {device!r}: expected cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(m.group(1) or 0)
        if index >= count:
            raise ValueError(f"{flag} {device!r}: this machine has {count} CUDA device(s)")


def check_strategies(
    specs: list[str], workloads: list[str], world: int, args: argparse.Namespace | None = None
) -> None:
    """Every spec fully checked, against the job's backend and device (`args.placement`)
    and against each workload's benchmark model."""
    from plait.train.strategy import Strategy, make_strategy
    from plait.workloads import get_workload

    if not specs:
        raise ValueError("--strategies: no strategy given; e.g. ssgd,acpsgd:rank=4")
    built = []
    for spec in specs:
        strategy = make_strategy(spec)
        built.append(strategy)
        if args is not None:
            check_backend(strategy, args)
    for w in workloads:
        wl = get_workload(w)
        model = None
        for strategy in built:
            if type(strategy).check is Strategy.check:
                continue  # nothing to check against the model: do not build it
            if model is None:
                model = wl.model(wl.bench_data(8).info, bench=True)
            strategy.check(model, world=world)
    for strategy in built:
        strategy.close()


def workload_list(text: str) -> list[str]:
    from plait.workloads import get_workload

    names = [w.strip() for w in text.split(",") if w.strip()]
    if not names:
        raise ValueError(f"--workload {text!r}: expected one or more workload names")
    for name in names:
        get_workload(name)
    return names
