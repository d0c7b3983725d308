"""Strategy specs in text: ``"name:key=value,key=value"``, and lists of them.

The command line and run configs name strategies this way (``acpsgd:rank=4``,
``plan:dp=2,tp=2``). This module only splits and types the text; what a name and its
options mean, and which options it accepts, is decided by the strategy that owns them.
"""

from __future__ import annotations

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
