"""The recipe reference (``docs/config_reference.md``), generated from the schema's own field comments.

Every recipe key is a field of a dataclass in ``nemo_ac.config.schema``, and its documentation is the source comment
next to it: a trailing ``x: int = 4  # comment`` and/or ``# comment`` lines directly above the field (no blank line
between). Those comments are read from the module's source with ``tokenize`` and ``ast`` (they are not docstrings);
each dataclass's docstring becomes its section's intro. The output is one markdown table per section: dotted key,
type (a ``Literal``'s choices), default, comment.

    python -m nemo_ac.config.reference                                   # print it
    python -m nemo_ac.config.reference --write docs/config_reference.md  # regenerate the checked-in file
    python -m nemo_ac.config.reference --check docs/config_reference.md  # exit 1 when that file is stale

Imports only ``nemo_ac.config`` and the standard library: it runs before (and without) any process group.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from nemo_ac.config.schema import RecipeConfig

DEFAULT_PATH = "docs/config_reference.md"
COMMAND = "python -m nemo_ac.config.reference"
REGENERATE = f"{COMMAND} --write {DEFAULT_PATH}"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str  # dotted recipe key, e.g. "model.moe.num_experts"
    type: str  # rendered type (markdown)
    default: str  # rendered default (markdown)
    comment: str  # the field's source comment; "" when it has none


@dataclasses.dataclass(frozen=True)
class Section:
    key: str  # dotted section key; "" for the recipe's top level
    cls_name: str  # the schema dataclass
    doc: str  # its docstring; "" when it has none
    rows: tuple[Row, ...]
    subsections: tuple[str, ...]  # dotted keys of the sections nested in this one


# --------------------------------------------------------------------------------------------------------------
# reading comments and docstrings from the source


def _comment_lines(source: str) -> tuple[dict[int, str], set[int]]:
    """Line number -> comment text, and the set of lines that hold nothing but a comment."""
    comments: dict[int, str] = {}
    own_line: set[int] = set()
    code_lines: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER, tokenize.ENCODING}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in skip:
            code_lines.update(range(tok.start[0], tok.end[0] + 1))
    own_line = {line for line in comments if line not in code_lines}
    return comments, own_line


def parse_schema_source(source: str) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """``source`` of a schema module -> ({class: {field: comment}}, {class: docstring}).

    A field's comment is the block of comment-only lines directly above it followed by any comments on the
    field's own lines, joined with spaces. A field without either maps to "".
    """
    comments, own_line = _comment_lines(source)
    fields: dict[str, dict[str, str]] = {}
    docs: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs[node.name] = inspect.cleandoc(ast.get_docstring(node) or "")
        per_field: dict[str, str] = {}
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            above: list[str] = []
            line = stmt.lineno - 1
            while line in own_line:
                above.insert(0, comments[line])
                line -= 1
            end = stmt.end_lineno or stmt.lineno
            trailing = [comments[n] for n in range(stmt.lineno, end + 1) if n in comments and n not in own_line]
            per_field[stmt.target.id] = " ".join(part for part in [*above, *trailing] if part)
        fields[node.name] = per_field
    return fields, docs


# --------------------------------------------------------------------------------------------------------------
# rendering types and defaults


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (typing.Union, types.UnionType) and type(None) in get_args(tp)


def render_type(tp: Any) -> str:
    if _is_optional(tp):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return " \\| ".join([*(render_type(a) for a in inner), "null"])
    origin = get_origin(tp)
    if origin is Literal:
        return " \\| ".join(f"`{choice}`" for choice in get_args(tp))
    if origin is list:
        (item,) = get_args(tp)
        return f"list[{render_type(item)}]"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def render_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    return f"`{_yaml_value(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# --------------------------------------------------------------------------------------------------------------
# walking the schema


def collect(root: type = RecipeConfig, source: str | None = None) -> list[Section]:
    """The sections of ``root`` (a schema dataclass), depth first in field order, the top level first."""
    module = sys.modules[root.__module__]
    comments, docs = parse_schema_source(inspect.getsource(module) if source is None else source)
    sections: list[Section] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        rows: list[Row] = []
        nested: list[tuple[type, str]] = []
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                nested.append((typing.cast(type, tp), key))
                continue
            comment = comments.get(cls.__name__, {}).get(f.name, "")
            rows.append(Row(key, render_type(tp), render_default(f), comment))
        sections.append(
            Section(prefix, cls.__name__, docs.get(cls.__name__, ""), tuple(rows), tuple(k for _, k in nested))
        )
        for sub, key in nested:
            walk(sub, key)

    walk(root, "")
    return sections


def missing_docs(sections: Sequence[Section]) -> list[str]:
    """Dotted keys of fields without a comment, and of nested sections whose dataclass has no docstring."""
    missing = [row.key for section in sections for row in section.rows if not row.comment]
    missing += [f"{section.key} (docstring of {section.cls_name})" for section in sections[1:] if not section.doc]
    return missing


def render(sections: Sequence[Section]) -> str:
    top, *rest = sections
    out = [
        "# Recipe reference",
        "",
        f"<!-- Generated from nemo_ac/config/schema.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "Every key a recipe YAML (or a `section.key=value` override) can set: the dataclasses of",
        "`nemo_ac/config/schema.py`, with each field's own comment. Unknown keys, wrong types and values outside the",
        "listed choices fail before any process group starts; cross-field rules are in `nemo_ac/config/validate.py`",
        f"(`nemo-ac validate RECIPE --world-size N` runs them). Regenerate this file with `{REGENERATE}`.",
        "",
    ]
    if top.doc:
        out += [top.doc, ""]
    out += ["Sections: " + ", ".join(f"`{s.key}`" for s in rest) + ".", ""]
    for section in sections:
        out += [f"## `{section.key}`" if section.key else "## Top level", ""]
        if section.key and section.doc:
            out += [section.doc, ""]
        if section.rows:
            out += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
            out += [f"| `{r.key}` | {r.type} | {r.default} | {_cell(r.comment)} |" for r in section.rows]
            out.append("")
        if section.subsections:
            out += ["Nested sections: " + ", ".join(f"`{k}`" for k in section.subsections) + ".", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def generate(root: type = RecipeConfig) -> str:
    return render(collect(root))


# --------------------------------------------------------------------------------------------------------------
# command line


def check(path: Path, text: str, *, shown: str | None = None) -> str | None:
    """None when ``path`` holds ``text``, else the message saying how to regenerate it (naming it ``shown``)."""
    current = path.read_text() if path.is_file() else None
    if current == text:
        return None
    name = shown or str(path)
    state = "does not exist" if current is None else "is out of date with nemo_ac/config/schema.py"
    return f"{name} {state}; regenerate it with: {COMMAND} --write {name}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n", 1)[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="PATH", type=Path, help="write the reference to PATH")
    group.add_argument("--check", metavar="PATH", type=Path, help="exit 1 when PATH differs from the generated text")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        message = check(args.check, text)
        if message:
            print(message, file=sys.stderr)
            return 1
        print(f"{args.check} is current")
        return 0
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(text)
        print(f"wrote {args.write}")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
