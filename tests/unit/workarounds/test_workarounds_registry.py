"""The workarounds registry: one row per torch failure, each module documents what the registry says, one gate
table, the README table generated from it, and no private-torch technique outside ``nemo_ac/workarounds``."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from nemo_ac import compat
from nemo_ac.doctor.checks import CHECKS
from nemo_ac.doctor.runner import PROBES
from nemo_ac.workarounds import GATES, WORKAROUNDS, markdown_table, workaround
from nemo_ac.workarounds.registry import TECHNIQUES

pytestmark = pytest.mark.workaround  # the torch-release regression subset (scripts/test_torch.sh)

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "nemo_ac"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("row", WORKAROUNDS, ids=lambda row: row.name)
def test_each_module_opens_with_the_error_versions_upstream_and_when_to_delete_it(row):
    doc = _flat(importlib.import_module(row.module).__doc__ or "")
    if row.kind == "technique":
        assert _flat(f"Relies on: {row.error}") in doc, f"{row.module} does not open with 'Relies on: {row.error}'"
    else:
        quoted = row.error.split(" ... ")[0].split(", then ")[0].split(", or")[0]
        quoted = quoted.removeprefix("silently wrong gradients")
        assert _flat(quoted).strip(" ,:") in doc, f"{row.module} does not quote {quoted!r}"
    assert "Upstream:" in doc and "Delete when:" in doc
    for upstream in row.upstream:
        assert upstream.ref in doc, f"{row.module} does not name {upstream.ref}"
        assert upstream.state in {"open", "closed", "closed unmerged", "merged"}


def test_one_gate_table_and_every_gated_row_has_its_gate():
    gated = {row.name for row in WORKAROUNDS if row.gated}
    assert gated == set(GATES), "a gate without a row, or a gated row without a gate"
    assert all(row.needed_probe or not row.gated or row.name in GATES for row in WORKAROUNDS)
    assert workaround("profiler_ops_in_sac").active(torch_version="2.13.0a0+abc")
    assert not workaround("profiler_ops_in_sac").active(torch_version="2.12.1")
    assert not workaround("fsdp_hooks_in_sac").active(torch_version="2.12.1")
    for release in ("2.13.0", "2.14.1", "2.15.0"):  # doctor: affected on each (README: torch compatibility)
        assert all(workaround(name).active(torch_version=release) for name in GATES)
    with pytest.raises(KeyError, match="known:"):
        workaround("no_such_failure")


def test_a_torch_outside_the_supported_releases_gets_one_header_line():
    """A source checkout on a machine's own torch (an H200 image held torch 2.11.0+cu130) is told, not refused;
    pre-release and local builds of a supported release are not (2.13.0a0 counts as 2.13)."""
    from nemo_ac.workarounds.gates import unsupported_torch_note

    for outside in ("2.11.0+cu130", "2.16.0.dev20270101"):
        note = unsupported_torch_note(outside)
        assert note is not None and outside in note and "2.12 - 2.15" in note
    for inside in ("2.12.1", "2.13.0a0+8145d630e8", "2.14.1+cu128", "2.15.0"):
        assert unsupported_torch_note(inside) is None


def test_doctor_and_compat_read_the_registry():
    for probe in PROBES:
        row = workaround(probe.fix)
        assert probe.workaround and probe.workaround in (row.compat or row.module)
        assert probe.gate("2.13.0") == row.active(torch_version="2.13.0")
    old = compat.status(torch_version="2.11.0")
    assert old.profiler_ops in ("not_needed", "upstream", "installed", "unavailable")
    assert not old.fsdp_units_need_protection and not old.recompute_needs_thread_context
    now = compat.status(torch_version="2.13.0")
    assert now.fsdp_units_need_protection and now.recompute_needs_thread_context


def test_every_module_has_a_row_and_the_doctor_checks_every_technique():
    """A module of workarounds/ (other than the registry and the gate table) is a row; a technique row (a private
    torch API relied on, no failure of its own) has exactly one doctor check, which names it."""
    modules = {path.stem for path in (PACKAGE / "workarounds").glob("*.py")} - {
        "__init__",
        "__main__",
        "gates",
        "registry",
    }
    assert modules == {row.name for row in WORKAROUNDS}, "a workarounds module without a registry row (or the reverse)"
    assert [check.row for check in CHECKS] == [row.name for row in TECHNIQUES]
    assert all(row.kind == "technique" and not row.gated for row in TECHNIQUES)
    assert {row.name for row in WORKAROUNDS if row.kind == "technique"} == {row.name for row in TECHNIQUES}


def test_the_doctor_probes_every_failure_row_and_checks_every_technique_row():
    """Every row of the registry is answered on the user's torch by ``nemo-ac doctor``: a failure row by at least
    one probe (off and on), whose name its ``delete_when`` gives; a technique row by its check."""
    probed = {row.name: [probe.name for probe in PROBES if probe.fix == row.name] for row in WORKAROUNDS}
    checked = {check.row for check in CHECKS}
    unanswered = [
        row.name for row in WORKAROUNDS if not (probed[row.name] if row.kind == "failure" else row.name in checked)
    ]
    assert not unanswered, f"registry rows nemo-ac doctor never probes or checks: {unanswered}"
    assert not [probe.fix for probe in PROBES if workaround(probe.fix).kind != "failure"]
    for row in (row for row in WORKAROUNDS if row.kind == "failure"):
        named = [name for name in probed[row.name] if re.search(rf"\b{name}\b", row.delete_when)]
        assert named, f"{row.name}: delete_when names none of its doctor probes {probed[row.name]}"


def test_the_readme_table_is_the_registry():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("<!-- workarounds:begin -->\n", 1)[1].split("<!-- workarounds:end -->", 1)[0]
    assert section == markdown_table(), "README workaround table is stale: python -m nemo_ac.workarounds --markdown"
    for row in WORKAROUNDS:
        assert (PACKAGE / "workarounds" / f"{row.name}.py").exists()
        assert (f"[`{row.name}`]" in section) == (row.kind == "failure"), "the README table lists the failure rows"


# Private-torch techniques: each lives behind one function in nemo_ac/workarounds and nowhere else.
PRIVATE_TECHNIQUES = {
    r"\.__class__\s*=": "re-classing torch's SAC modes",
    r"_higher_order_ops\b": "higher-order-op redirects",
    r"python_key_table": "higher-order-op redirects",
    r"_get_dict\(": "ConfigModule internals",
    r"_meta_registrations|FakeTensorMode\(\)": "fake rules",
}


def test_private_torch_techniques_live_only_in_workarounds():
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "workarounds" in path.parts:
            continue
        code = path.read_text()
        for pattern, what in PRIVATE_TECHNIQUES.items():
            for match in re.finditer(pattern, code):
                line = code[: match.start()].count("\n") + 1
                text = code.splitlines()[line - 1].strip()
                if not text.startswith("#") and '"""' not in text and "``" not in text:
                    offenders.append(f"{path.relative_to(ROOT)}:{line} ({what}): {text}")
    assert not offenders, "\n".join(offenders)


def test_version_gates_are_defined_only_in_the_gate_table():
    """No release comparison and no ``*_SINCE`` constant outside gates.py (the old tree had three such places)."""
    pattern = re.compile(
        r"torch_version_release\([^)]*\)\s*[<>]=?|\brelease\s*[<>]=?\s*\(\s*2\s*,|^[A-Z_]+_SINCE\s*=", re.MULTILINE
    )
    offenders = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in PACKAGE.rglob("*.py")
        if path.name != "gates.py"
        for match in pattern.finditer(path.read_text())
    ]
    assert not offenders, offenders
