"""Griffe extension for the API reference: command lines in docstrings as code blocks.

plait's docstrings show how to run a module as an indented command line
(``    python -m plait.bench.timeline TRACE``). Markdown reads such a line as code only when
it does not follow a list; after a list it joins the last item, and its ``[--flag X]``
parts look like links. Fencing every indented ``python -m``/``plait`` block renders them
all the same way.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

COMMAND = re.compile(r"^( {4,})(python -m |plait )")


def fence_commands(text: str) -> str:
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        match = COMMAND.match(lines[i])
        if match and (i == 0 or not lines[i - 1].strip()):
            indent = match.group(1)
            out.append("```bash")
            while i < len(lines) and lines[i].startswith(indent) and lines[i].strip():
                out.append(lines[i][len(indent) :])
                i += 1
            out.append("```")
            continue
        out.append(lines[i])
        i += 1
    return "\n".join(out)


class CommandBlocks(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_commands(obj.docstring.value)
