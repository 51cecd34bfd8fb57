"""Every README command marked ``<!-- readme-command -->`` runs as printed, so an example cannot rot unnoticed.

The README's marked blocks hold commands a new user types on a CPU machine: ``torchrun ... -m nemo_ac.train`` and
``nemo-ac ...`` (recipes, validate, plan, tokenize, doctor, train, export). They run in the README's order (export reads the
checkpoint the train command before it saved), in a fresh directory that holds only a ``recipes`` link to the
checkout (the README's paths are relative to a checkout), with ``OMP_NUM_THREADS=1``. Each must exit 0 and print the
line that says it did its job: validate's ``OK at world size N``, the trainer's ``summary | steps N``, export's
``export | step N of ... -> OUT``. A marked command of a kind this module has no expected line for fails the test:
add its line here rather than leaving it unchecked.

What the README says before this test existed and was false: ``nemo-ac validate recipes/tiny/qwen3_moe_tiny.yaml
--world-size 8`` exited 2 (global batch 8 is not divisible by dp 8 x micro 2), and ``nemo-ac export
runs/qwen3_moe_tiny`` could not work (the tiny recipes save no checkpoint unless asked to).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.launch import ROOT, child_env

pytestmark = pytest.mark.functional

README = ROOT / "README.md"
MARKER = "<!-- readme-command -->"
BLOCK = re.compile(re.escape(MARKER) + r"\n```bash\n(.*?)```", re.DOTALL)
TIMEOUT_S = 180


@dataclass(frozen=True)
class Command:
    text: str  # as printed in the README, without its comment
    argv: list[str]  # what runs: nemo-ac -> python -m nemo_ac.cli, torchrun -> python -m torch.distributed.run

    @property
    def expected(self) -> re.Pattern[str]:
        return expected_line(self.argv)


def marked_commands(readme: str) -> list[Command]:
    """The commands of every ``bash`` block right after a marker, in README order (``#`` starts a comment)."""
    assert readme.count(MARKER) == len(BLOCK.findall(readme)), f"every {MARKER} must precede a ```bash block"
    commands = []
    for block in BLOCK.findall(readme):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                commands.append(Command(text=shlex.join(words), argv=_executable(words)))
    return commands


def _executable(words: list[str]) -> list[str]:
    """``nemo-ac`` and ``torchrun`` as this interpreter runs them (no console script needs to be on PATH)."""
    programs = {
        "nemo-ac": [sys.executable, "-m", "nemo_ac.cli"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    }
    assert words[0] in programs, f"a README command starts with nemo-ac or torchrun, not {words[0]!r}"
    return programs[words[0]] + words[1:]


def _value(argv: list[str], *, flag: str = "", key: str = "") -> str:
    """The value after ``flag`` or of the override ``key=value`` in ``argv``."""
    for i, word in enumerate(argv):
        if flag and word == flag:
            return argv[i + 1]
        if key and word.startswith(f"{key}="):
            return word.split("=", 1)[1]
    raise AssertionError(f"the README command {shlex.join(argv)!r} sets no {flag or key}")


def expected_line(argv: list[str]) -> re.Pattern[str]:
    """The output line that shows the command did its job (a regex matched against each line)."""
    if "nemo_ac.train" in argv or argv[3:4] == ["train"]:
        return re.compile(rf"^summary \| steps {_value(argv, key='train.steps')} \|")
    sub = argv[3] if argv[1:3] == ["-m", "nemo_ac.cli"] else ""
    if sub == "validate":
        return re.compile(rf": OK at world size {_value(argv, flag='--world-size')}: dp_replicate")
    if sub == "plan":
        return re.compile(r"^memory \| peak [\d.]+ \w+ per rank")
    if sub == "doctor":
        return re.compile(r"^OK: every affected probe passes with its workaround")
    if sub == "tokenize":
        return re.compile(r"^data \| (tokenized [\d,]+ rows|mapped) ")
    if sub == "recipes":
        return re.compile(r"^tiny/qwen3_moe_tiny\s+\S")
    if sub == "export":
        return re.compile(rf"^export \| step \d+ of .* -> {re.escape(_value(argv, flag='--out'))}$")
    if sub == "--version":
        return re.compile(r"^nemo-ac \d+\.\d+")
    raise AssertionError(f"no expected output line for the README command {shlex.join(argv)!r}: add one here")


def run_command(command: Command, cwd: Path) -> tuple[bool, str]:
    """Run one command in ``cwd``; (passed, what to report)."""
    started = time.perf_counter()
    proc = subprocess.run(
        command.argv, cwd=cwd, env=child_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    seconds = time.perf_counter() - started
    if proc.returncode != 0:
        return False, f"{command.text}: exit code {proc.returncode} ({seconds:.1f} s)\n{output[-3000:]}"
    if not any(command.expected.search(line) for line in output.splitlines()):
        return False, f"{command.text}: no line matches {command.expected.pattern!r}\n{output[-3000:]}"
    return True, f"{command.text}: ok ({seconds:.1f} s)"


def checkout_like(tmp_path: Path) -> Path:
    """A fresh working directory where the README's ``recipes/...`` paths resolve, as in a checkout."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes", target_is_directory=True)
    return tmp_path


def test_readme_marks_the_commands_a_new_user_runs():
    commands = marked_commands(README.read_text())
    kinds = {c.argv[3] if c.argv[2] == "nemo_ac.cli" else "torchrun" for c in commands}
    assert {"torchrun", "recipes", "validate", "plan", "doctor", "train", "export"} <= kinds, kinds
    for command in commands:
        command.expected  # noqa: B018 -- raises for a command this module cannot check


def test_every_marked_readme_command_runs(tmp_path):
    cwd = checkout_like(tmp_path)
    results = [run_command(command, cwd) for command in marked_commands(README.read_text())]
    failed = [report for passed, report in results if not passed]
    assert not failed, "\n\n".join(failed)


def test_a_broken_command_fails_the_check(tmp_path):
    """The check can fail: the README's validate command with a recipe name that does not exist."""
    validate = next(c for c in marked_commands(README.read_text()) if c.argv[3] == "validate")
    broken_text = validate.text.replace("qwen3_moe_tiny", "qwen3_moe_tinyy")
    assert broken_text != validate.text
    broken = marked_commands(f"{MARKER}\n```bash\n{broken_text}\n```\n")
    passed, report = run_command(broken[0], checkout_like(tmp_path))
    assert not passed and "exit code 2" in report, report
