#!/usr/bin/env python3
"""Generate the reference pages from the code: ``docs/reference/config.md`` (every field of a run config, from
the pydantic models under :class:`astraflow.config.RunConfig`: its type, default and description) and
``docs/reference/cli.md`` (every ``astraflow`` command, its arguments and options, from the typer app).

Usage: ``scripts/gen_reference.py`` writes both pages; ``scripts/gen_reference.py --check`` writes nothing and
exits 1 when a committed page differs from what the code generates (``tests/scripts/test_gen_reference.py``
runs it), or when a config field has no description.
"""
from __future__ import annotations

import argparse
import enum
import inspect
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG_PAGE = ROOT / "docs" / "reference" / "config.md"
CLI_PAGE = ROOT / "docs" / "reference" / "cli.md"


def _models_in(annotation: typing.Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through list, dict, tuple, Union, Optional and Annotated)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _type_name(annotation: typing.Any) -> str:
    """A readable type: ``int | None``, ``list[SourceConfig]``, ``Literal['a', 'b']``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return "Literal[" + ", ".join(repr(a) for a in args) + "]"
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(_type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation).replace("typing.", ""))


def _default(field: typing.Any) -> str:
    """The field's default as YAML would write it; ``required`` when it has none."""
    if field.default_factory is not None:
        value = field.default_factory()
        if isinstance(value, BaseModel):
            return f"(`{type(value).__name__}` defaults)"
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, Path):
        value = str(value.relative_to(ROOT)) if value.is_relative_to(ROOT) else str(value)
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _cell(text: str) -> str:
    """Text fit for one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def config_models(root: type[BaseModel]) -> list[tuple[type[BaseModel], list[str]]]:
    """Every model reachable from ``root``, depth first in field order, each with the config paths it sits at
    (``policies.<policy>.trainer``; ``[]`` for a list item, ``<key>`` for a mapping's value)."""
    found: dict[type[BaseModel], list[str]] = {root: [""]}
    order = [root]

    def visit(model: type[BaseModel], path: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            suffix = ""
            if typing.get_origin(annotation) is dict:
                suffix = ".<key>"
            elif typing.get_origin(annotation) in (list, tuple):
                suffix = "[]"
            for sub in _models_in(annotation):
                sub_path = f"{path}{name}{suffix}"
                if sub not in found:
                    found[sub] = [sub_path]
                    order.append(sub)
                    visit(sub, sub_path + ".")
                elif sub_path not in found[sub]:
                    found[sub].append(sub_path)

    visit(root, "")
    return [(m, found[m]) for m in order]


def undescribed(root: type[BaseModel]) -> list[str]:
    """``Model.field`` for every field reachable from ``root`` without a description."""
    return [f"{m.__name__}.{name}" for m, _ in config_models(root) for name, f in m.model_fields.items()
            if not f.description]


def config_reference() -> str:
    """The markdown of ``docs/reference/config.md``."""
    from astraflow.config import RunConfig

    lines = ["# Configuration reference", "",
             "Every field of a run config (`astraflow run CONFIG.yaml key=value ...`), generated from the config "
             "models by `scripts/gen_reference.py`: do not edit by hand. A field set to a value it refuses, or a "
             "field that does not exist, stops the run before it starts with the field named.", ""]
    for model, paths in config_models(RunConfig):
        where = ", ".join(f"`{p}`" for p in paths if p) or "the top level of the file"
        lines += [f"## {model.__name__}", "", f"At {where}.", "", "| field | type | default | description |",
                  "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            lines.append(f"| `{name}` | `{_cell(_type_name(field.annotation))}` | {_cell(_default(field))} | "
                         f"{_cell(field.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def cli_reference() -> str:
    """The markdown of ``docs/reference/cli.md``."""
    import typer

    from astraflow.cli import app

    group = typer.main.get_command(app)
    lines = ["# Command-line reference", "",
             "Every `astraflow` command, generated from the CLI by `scripts/gen_reference.py`: do not edit by hand. "
             "`astraflow COMMAND --help` prints the same.", ""]
    for name in sorted(group.commands):
        command = group.commands[name]
        if command.hidden:
            continue
        usage = " ".join([f"astraflow {name}"] + [
            (p.name.upper() if p.required else f"[{p.name.upper()}]") + ("..." if p.nargs == -1 else "")
            for p in command.params if not p.opts[0].startswith("-")] + (["[OPTIONS]"] if any(
                p.opts[0].startswith("-") for p in command.params) else []))
        lines += [f"## `astraflow {name}`", "", "```", usage, "```", "", inspect.cleandoc(command.help or ""), ""]
        if command.params:
            lines += ["| argument or option | default | description |", "|---|---|---|"]
            for p in command.params:
                label = ", ".join(p.opts + list(getattr(p, "secondary_opts", []) or [])) \
                    if p.opts[0].startswith("-") else p.name.upper()
                default = "required" if p.required else ("" if p.default is None else f"`{p.default}`")
                lines.append(f"| `{label}` | {default} | {_cell(p.help or '')} |")
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Write the pages, or with ``--check`` compare them; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    from astraflow.config import RunConfig

    missing = undescribed(RunConfig)
    if missing:
        print(f"config fields without a description: {', '.join(missing)}", file=sys.stderr)
        return 1
    stale = []
    for page, text in ((CONFIG_PAGE, config_reference()), (CLI_PAGE, cli_reference())):
        if args.check:
            if not page.exists() or page.read_text() != text:
                stale.append(str(page.relative_to(ROOT)))
        else:
            page.parent.mkdir(parents=True, exist_ok=True)
            page.write_text(text)
            print(f"wrote {page.relative_to(ROOT)}")
    if stale:
        print(f"out of date (run scripts/gen_reference.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
