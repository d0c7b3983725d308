"""Strategy specs in text: ``"name:key=value,key=value"``, and lists of them.

The command line and run configs name strategies this way (``acpsgd:rank=4``,
``plan:dp=2,tp=2``). This module only splits and types the text; what a name and its
options mean, and which options it accepts, is decided by the strategy that owns them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path

OptionValue = int | float | bool | str


def _parse_value(text: str) -> OptionValue:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, OptionValue]]:
    """Split ``"name:k=v,k2=v2"`` into the name and typed options.

    Raises:
        ValueError: an item that is not ``key=value``, or a key given twice.
    """
    name, _, rest = spec.strip().partition(":")
    options: dict[str, OptionValue] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise ValueError(f"invalid strategy option {item!r} in {spec!r}: expected key=value")
        if key in options:
            raise ValueError(f"option {key!r} given twice in {spec!r}")
        options[key] = _parse_value(value.strip())
    return name.strip(), options


def split_specs(text: str) -> list[str]:
    """Split a strategy list; options use commas too, so ';' separates when present."""
    if ";" in text:
        return [s.strip() for s in text.split(";") if s.strip()]
    out: list[str] = []
    for part in (s.strip() for s in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out:
            out[-1] += "," + part  # an option of the previous spec
        else:
            out.append(part)
    return out


def import_target(target: str, *, what: str) -> object:
    """Import the module a user names: a dotted module (``pkg.module``) or a Python file
    (``path/to/file.py``), once per process.

    Workload factories, sweep search spaces and every other ``target:attr`` the command line
    takes go through here, so their errors read alike; `what` names the kind of thing in
    them (``"workload factory"``).

    Raises:
        ValueError: the file does not exist or is not Python, or the import fails.
    """
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = Path(target).expanduser()
        if not path.is_file():
            raise ValueError(f"{what} file {target!r} does not exist")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]
        name = f"plait_user_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"{what} file {target!r} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise ValueError(f"{what} file {target!r} failed to import: {e!r}") from e
        return module
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        # `plait` runs from its script's folder, not the current one: a module beside the
        # user (`--workload mywork:make` with ./mywork.py) is found as `python -m` would
        top = target.split(".", maxsplit=1)[0]
        here = Path.cwd()
        beside = (here / f"{top}.py").is_file() or (here / top / "__init__.py").is_file()
        if e.name != top or not beside or str(here) in sys.path:
            raise ValueError(f"{what} module {target!r} does not import: {e}") from e
        sys.path.insert(0, str(here))
        return import_target(target, what=what)
    except ImportError as e:
        raise ValueError(f"{what} module {target!r} does not import: {e}") from e
