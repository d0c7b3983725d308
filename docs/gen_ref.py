"""API reference: one page per public module of src/plait, written at build time.

Private modules (a name part starting with `_`), `__main__` and non-Python sources are
skipped. Each page holds one mkdocstrings directive; a package's page lists what it
re-exports with links to the defining modules, so every object is documented once. The
"API reference" entry of the navigation is expanded into one section per subpackage.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import griffe
import mkdocs_gen_files

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PACKAGE = "plait"
INDEX = "reference/index.md"


def public_modules() -> list[tuple[str, Path]]:
    found = []
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] == "__main__" or any(p.startswith("_") for p in parts):
            continue
        found.append((parts, path))
    found.sort(key=lambda item: item[0])
    return [(".".join(parts), path) for parts, path in found]


def summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return doc.strip().splitlines()[0] if doc else ""


def page_of(module: str) -> str:
    return f"reference/{module}.md"


def first_line(obj: griffe.Object | griffe.Alias) -> str:
    doc = obj.docstring.value.strip() if obj.docstring else ""
    return doc.splitlines()[0].replace("|", "\\|") if doc else ""


def package_page(module: str) -> str:
    """A package's own docstring and members, then its exports linked to where they live.

    Re-exported objects are documented once, on the page of the module that defines them.
    """
    pkg = api if module == PACKAGE else api[module.removeprefix(PACKAGE + ".")]
    own = [
        name
        for name, member in pkg.members.items()
        if not name.startswith("_") and not member.is_alias and not member.is_module
    ]
    members = "[" + ", ".join(own) + "]" if own else "false"
    text = f"# `{module}`\n\n::: {module}\n    options:\n      members: {members}\n"
    rows = []
    for name in [str(e) for e in (pkg.exports or [])]:
        member = pkg.members.get(name)
        if name.startswith("_") or member is None or not member.is_alias:
            continue
        try:
            target = member.final_target
        except griffe.AliasResolutionError:
            rows.append(f"| `{name}` | |")
            continue
        private = any(part.startswith("_") for part in target.path.split("."))
        link = f"`{name}`" if private else f"[`{name}`][{target.path}]"
        rows.append(f"| {link} | {first_line(target)} |")
    if rows:
        text += "\n## Exports\n\n| name | summary |\n|---|---|\n" + "\n".join(rows) + "\n"
    return text


modules = public_modules()
api = griffe.load(PACKAGE, search_paths=[str(SRC)], resolve_aliases=True, resolve_external=False)

for module, path in modules:
    page = page_of(module)
    with mkdocs_gen_files.open(page, "w") as fh:
        if path.name == "__init__.py":
            fh.write(package_page(module))
        else:
            fh.write(f"# `{module}`\n\n::: {module}\n")
    mkdocs_gen_files.set_edit_path(page, path.relative_to(ROOT).as_posix())

with mkdocs_gen_files.open(INDEX, "w") as fh:
    fh.write(
        "# API reference\n\n"
        "Generated from the docstrings of `src/plait` at build time, one page per public "
        "module. The entry points most programs need are `plait.data_parallel`, "
        "`plait.kfac.KFAC`, `plait.fuse`, `plait.crossover.attach` and "
        "`plait.parallelize`; the [user guide](../guide/data-parallel.md) shows them in use.\n\n"
        "| module | summary |\n|---|---|\n"
    )
    for module, path in modules:
        text = summary(path).replace("|", "\\|")
        fh.write(f"| [`{module}`]({module}.md) | {text} |\n")


def reference_nav() -> list[Any]:
    """[index, plait's own modules..., {"plait.X": [plait.X, plait.X.y, ...]}, ...]."""
    top: list[Any] = [INDEX]
    sections: dict[str, list[Any]] = {}
    for module, _ in modules:
        parts = module.split(".")
        if len(parts) == 1 or (len(parts) == 2 and not (SRC / PACKAGE / parts[1]).is_dir()):
            top.append({module: page_of(module)})
        else:
            key = ".".join(parts[:2])
            sections.setdefault(key, []).append({module: page_of(module)})
    return top + [{key: entries} for key, entries in sections.items()]


def expand(nav: list[Any], entries: list[Any]) -> bool:
    for item in nav:
        if not isinstance(item, dict):
            continue
        for title, value in item.items():
            if value == INDEX or (isinstance(value, list) and value[:1] == [INDEX]):
                item[title] = entries
                return True
            if isinstance(value, list) and expand(value, entries):
                return True
    return False


config = mkdocs_gen_files.config
if config.nav is not None:
    expand(config.nav, reference_nav())
