"""``python -m plait.bench.project profile|validate|map``: the suite ``project``
(`plait.bench.suites`; its commands in `plait.bench.project.commands`)."""

from __future__ import annotations

from plait.bench import suites


def main(argv: list[str] | None = None) -> int:
    """``python -m plait.bench.project``: the suite ``project``."""
    return suites.main("project", argv)


if __name__ == "__main__":
    raise SystemExit(main())
