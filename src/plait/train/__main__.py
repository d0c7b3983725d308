"""Worker entry point: ``torchrun ... -m plait.train --workload mlp --strategy ssgd ...``.

`plait train` launches this on every node with ``--config-json``; on a real cluster run it
under torchrun directly with the same flags as `plait train`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from plait import distributed as pdist
from plait.cluster.agent import report_fatal
from plait.log import configure
from plait.persist import CheckpointError
from plait.train.config import TrainConfig
from plait.train.loop import train


def main(argv: list[str] | None = None) -> int:
    configure()  # the level `plait` set in PLAIT_LOG_LEVEL, INFO under a plain torchrun
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--config-json"]:
        cfg = TrainConfig(**json.loads(Path(args[1]).read_text()))
    else:
        from plait.train.args import add_train_args, config_from_args

        parser = argparse.ArgumentParser(prog="python -m plait.train")
        add_train_args(parser)
        cfg = config_from_args(parser.parse_args(args))
    try:
        train(cfg)
    except (CheckpointError, ValueError) as exc:
        # a full disk, a refused checkpoint or a bad setting fails every restart alike:
        # tell the launcher not to spend the restarts on it
        report_fatal(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        pdist.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
