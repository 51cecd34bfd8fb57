"""docs/config_reference.md is generated from the schema's own field comments (nemo_ac/config/reference.py).

- The checked-in file equals the generated text; a stale file fails with the command that regenerates it.
- Every schema field (and every section) appears in it, and every field has a comment in schema.py: a field added
  without one fails here, as the synthetic schema below shows.
- The generator reads trailing comments and comment blocks above a field, renders Literal choices, and imports no
  torch (it runs before any process group).
"""

from __future__ import annotations

import dataclasses
import importlib
import subprocess
import sys
import textwrap
import typing

import pytest

from nemo_ac.config import reference
from nemo_ac.config.schema import RecipeConfig
from tests.launch import ROOT

CHECKED_IN = ROOT / "docs" / "config_reference.md"


def _schema_keys(cls: type, prefix: str = "") -> tuple[list[str], list[str]]:
    """(leaf keys, section keys) of a schema dataclass, walked independently of the generator."""
    leaves: list[str] = []
    sections: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}.{f.name}" if prefix else f.name
        if dataclasses.is_dataclass(hints[f.name]):
            sections.append(key)
            sub_leaves, sub_sections = _schema_keys(hints[f.name], key)
            leaves += sub_leaves
            sections += sub_sections
        else:
            leaves.append(key)
    return leaves, sections


def test_checked_in_reference_is_current():
    message = reference.check(CHECKED_IN, reference.generate(), shown=reference.DEFAULT_PATH)
    assert message is None, message
    assert reference.REGENERATE == "python -m nemo_ac.config.reference --write docs/config_reference.md"


def test_every_schema_field_appears():
    text = CHECKED_IN.read_text()
    leaves, sections = _schema_keys(RecipeConfig)
    assert len(leaves) > 150  # the walk reached the nested sections
    missing = [key for key in leaves if f"| `{key}` |" not in text]
    missing += [key for key in sections if f"\n## `{key}`\n" not in text]
    assert not missing, f"not in {CHECKED_IN.name}: {missing}; regenerate with {reference.REGENERATE}"


def test_every_field_has_a_comment():
    missing = reference.missing_docs(reference.collect())
    assert not missing, (
        f"schema fields without a comment in nemo_ac/config/schema.py: {missing}. Add a '# ...' line above the "
        f"field or a trailing comment (a docstring for a section's dataclass), then run {reference.REGENERATE}"
    )


FAKE_SCHEMA = '''
"""A schema of two sections, for the generator's own tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class Inner:
    """The inner section."""

    # Above the field,
    # on two lines.
    width: int = 4  # and trailing.

    undocumented: float = 0.5
    # A comment separated from the field by a blank line belongs to nothing.

    choice: Literal["a", "b"] | None = None  # pick | or not


@dataclass
class Outer:
    name: str = ""  # the name
    sizes: list[int] = field(default_factory=lambda: [1, 2])  # a list
    inner: Inner = field(default_factory=Inner)
'''


@pytest.fixture
def fake_schema(tmp_path, monkeypatch):
    (tmp_path / "nemo_ac_fake_schema.py").write_text(textwrap.dedent(FAKE_SCHEMA))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("nemo_ac_fake_schema")
    yield module
    sys.modules.pop("nemo_ac_fake_schema", None)


def test_a_field_without_comment_is_reported(fake_schema):
    sections = reference.collect(fake_schema.Outer)
    assert [s.key for s in sections] == ["", "inner"]
    rows = {row.key: row for s in sections for row in s.rows}
    assert rows["inner.width"].comment == "Above the field, on two lines. and trailing."
    assert rows["inner.undocumented"].comment == ""
    assert rows["inner.choice"].type == "`a` \\| `b` \\| null"
    assert rows["inner.choice"].default == "`null`"
    assert rows["sizes"].type == "list[int]" and rows["sizes"].default == "`[1, 2]`"
    assert rows["name"].default == '`""`'
    # The undocumented field fails the check; the top level needs no docstring, a nested section does have one.
    assert reference.missing_docs(sections) == ["inner.undocumented"]
    text = reference.render(sections)
    assert "## `inner`\n\nThe inner section.\n" in text
    assert "| `inner.choice` | `a` \\| `b` \\| null | `null` | pick \\| or not |" in text


def test_check_names_the_regenerate_command(tmp_path, capsys):
    path = tmp_path / "config_reference.md"
    assert reference.main(["--check", str(path)]) == 1
    assert f"regenerate it with: python -m nemo_ac.config.reference --write {path}" in capsys.readouterr().err
    assert reference.main(["--write", str(path)]) == 0
    assert reference.main(["--check", str(path)]) == 0
    path.write_text(path.read_text() + "edited by hand\n")
    assert reference.main(["--check", str(path)]) == 1
    assert "is out of date with nemo_ac/config/schema.py" in capsys.readouterr().err


def test_generator_imports_no_torch():
    code = "import sys, nemo_ac.config.reference as r; r.generate(); assert 'torch' not in sys.modules, 'torch'"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
