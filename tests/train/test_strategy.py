from __future__ import annotations

import subprocess
import sys
import textwrap


def test_concurrent_first_lookups_wait_for_the_plugins() -> None:
    """Two threads asking for a strategy at once (co-located jobs launched from one
    process) both find it, although the first one is still importing the plugins. Run
    in a fresh interpreter: the plugins load once per process."""
    script = textwrap.dedent(
        """
        import importlib, threading, time
        from plait.train import strategy

        def slow_import(name):
            time.sleep(0.2)  # widen the window in which the registry is half-filled
            return importlib.import_module(name)

        strategy.importlib = type("Slow", (), {"import_module": staticmethod(slow_import)})
        errors = []

        def lookup():
            try:
                strategy.make_strategy("spd-kfac").close()
            except Exception as exc:
                errors.append(repr(exc))

        first = threading.Thread(target=lookup)
        first.start()
        time.sleep(0.05)
        lookup()
        first.join()
        print(errors)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
