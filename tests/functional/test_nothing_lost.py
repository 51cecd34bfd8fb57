"""Nothing lost, every bad input named: ``nemo-ac export`` never destroys what it reads, and a stop always stops.

Export cases run on one real run (the tiny recipe trained 2 steps in a world of one, checkpoints step_1 and step_2),
through ``nemo-ac export`` itself (in process where the exit code and stderr are all there is to see; in a
subprocess where the filesystem must be read-only or full). Measured on the code before these checks: ``--out RUN``
and ``--out RUN/checkpoints`` deleted the run (exit 2, "step_2/nemo_ac_checkpoint.json: missing"), ``--out RUN/hf``
and an ``--out`` of unrelated files were written over (exit 0), a read-only ``--out`` was an ``OSError`` traceback,
a checkpoint of another model shape a DCP ``CheckpointException`` traceback.

The stop case is a real ``nemo-ac train`` on 2 ranks (torchrun through nemo_ac.launch) whose step compiles on a
cold inductor cache while SIGTERM reaches the launcher: before the stop deadline, torchrun SIGKILLed the ranks
after its 30 s grace (``forcefully exiting via 9``, exit 143) and no nemo_ac line was printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_ac.cli import main as cli
from tests.launch import RECIPES, ROOT, child_env

pytestmark = pytest.mark.functional

TINY = RECIPES / "tiny" / "qwen3_moe_tiny.yaml"
EXPORT_MARKER = (
    "nemo_ac_export.json"  # what every export writes (nemo_ac.trainer.checkpoint.export_target), as documented
)
TWO_STEPS = ["train.steps=2", "train.warmup_steps=1", "checkpoint.enabled=true", "checkpoint.every_n_steps=1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real run directory: recipe.yaml, metrics.jsonl, summary.json, checkpoints/{step_1,step_2,latest}."""
    run = tmp_path_factory.mktemp("trained") / "run"
    command = [sys.executable, "-m", "nemo_ac.train", str(TINY), *TWO_STEPS]
    command += [f"logging.run_dir={run}", "logging.progress_bar=never"]
    proc = subprocess.run(command, env=child_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


@pytest.fixture
def run_dir(trained, tmp_path) -> Path:
    """This test's copy of the trained run (``tmp_path/run``): a test that loses it loses only its own."""
    return Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (and every directory, so an added empty one counts) -> sha256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "<dir>"
        for p in sorted(root.rglob("*"))
    }


def export(capsys, *args: object) -> tuple[int, list[str]]:
    """``nemo-ac export ARGS``: exit code and the non-empty stderr lines."""
    code = cli(["export", *map(str, args)])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_export_into_the_run_or_its_checkpoints_is_refused_and_every_file_stays_byte_for_byte(
    run_dir, capsys, monkeypatch
) -> None:
    before = tree(run_dir)
    (run_dir.parent / "link").symlink_to(run_dir)
    ckpt = run_dir / "checkpoints"
    cases = [
        (run_dir, run_dir, "is the run directory; the export replaces --out whole and would delete it"),
        (run_dir, ckpt, "is the checkpoint directory; the export replaces --out whole and would delete it"),
        (run_dir, ckpt / "step_2", "is the checkpoint being read; the export replaces --out whole"),
        (ckpt / "step_1", ckpt / "step_2", f"lies inside the checkpoint directory {ckpt}; an export must not write"),
        (run_dir, run_dir / "hf", f"lies inside the run directory {run_dir}; an export must not write into"),
        (ckpt, run_dir.parent, f"contains the checkpoint being read {ckpt / 'step_2'}; the export replaces"),
        (run_dir, run_dir.parent / "link", f"is the run directory {run_dir}; the export replaces --out whole"),
    ]
    for given, out, expected in cases:
        code, lines = export(capsys, given, "--out", out)
        assert code == 2 and len(lines) == 1, (out, lines)
        assert lines[0].startswith(f"nemo-ac export: --out {out} {expected}"), lines[0]
        assert "choose a directory outside" in lines[0]
    monkeypatch.chdir(ckpt)  # relative paths are resolved too
    code, lines = export(capsys, "..", "--out", ".")
    assert code == 2 and lines == [
        "nemo-ac export: --out . is the checkpoint directory ../checkpoints; the export replaces --out whole and "
        "would delete it: choose a directory outside it"
    ], lines
    (run_dir.parent / "link").unlink()
    assert tree(run_dir) == before  # recipe.yaml, metrics, both checkpoints: every byte where it was
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["run"]  # no .partial, no probe left anywhere


def test_a_non_empty_out_that_is_no_export_needs_force_and_an_earlier_export_does_not(
    run_dir, tmp_path, capsys
) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("not an export")
    code, lines = export(capsys, run_dir, "--out", mine)
    assert code == 2 and lines == [
        f"nemo-ac export: --out {mine} is not empty (notes.txt) and holds no earlier nemo_ac export (no "
        f"{EXPORT_MARKER}), so replacing it would delete them; choose a new or empty directory, or pass --force to "
        "replace it"
    ]
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert export(capsys, run_dir, "--out", mine, "--force") == (0, [])
    assert sorted(p.name for p in mine.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        EXPORT_MARKER,
    ]
    marker = json.loads((mine / EXPORT_MARKER).read_text())
    assert (
        marker["format"] == "nemo_ac_export"
        and marker["step"] == 2
        and marker["source"] == str((run_dir / "checkpoints" / "step_2").resolve())
    )
    assert export(capsys, run_dir, "--out", mine) == (0, [])  # an earlier export is replaced without --force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "run"]  # swapped in, nothing beside it


def _unshare_works() -> bool:
    """A user + mount namespace (``unshare -rm``): a read-only bind mount or a small tmpfs without privileges."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode == 0


def _in_namespace(mount: str, script: str, run_dir: Path) -> subprocess.CompletedProcess:
    """Run ``script`` (python) after ``mount`` (shell) in a fresh user + mount namespace; ``sys.argv[1]`` is the run."""
    shell = f'{mount} && exec "$0" -c "$1" "$2"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell, sys.executable, textwrap.dedent(script), str(run_dir)],
        env=child_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


EXPORT_SCRIPT = """
import sys
from nemo_ac.cli import main
sys.exit(main(["export", sys.argv[1], "--out", sys.argv[2]]))
"""


def test_a_read_only_out_is_refused_in_one_line_before_anything_is_loaded(run_dir, tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    out = ro / "hf"
    if os.geteuid() != 0:
        ro.chmod(0o555)
        proc = subprocess.run(
            [sys.executable, "-m", "nemo_ac.cli", "export", str(run_dir), "--out", str(out)],
            env=child_env(),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        reason = "Permission denied"
    elif _unshare_works():  # root writes through permission bits: a read-only mount is what refuses it
        proc = _in_namespace(
            f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}",
            EXPORT_SCRIPT.replace("sys.argv[2]", repr(str(out))),
            run_dir,
        )
        reason = "Read-only file system"
    else:
        pytest.skip("running as root without unshare: no way to make a directory read-only here")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"nemo-ac export: --out {out} cannot be written: {ro} is not writable ({reason}); choose a writable location"
    ]
    assert "export |" not in proc.stdout  # refused before the checkpoint was loaded


def test_a_checkpoint_of_another_model_shape_is_one_line_and_the_earlier_export_stands(
    run_dir, tmp_path, capsys
) -> None:
    good = tmp_path / "good"
    assert export(capsys, run_dir, "--out", good) == (0, [])
    exported = tree(good)
    other = tmp_path / "other" / "step_2"
    shutil.copytree(run_dir / "checkpoints" / "step_2", other)
    manifest = json.loads((other / "nemo_ac_checkpoint.json").read_text())
    manifest["recipe"]["model"]["vocab_size"] = 262  # the recipe of another model than the shards hold
    (other / "nemo_ac_checkpoint.json").write_text(json.dumps(manifest))
    code, lines = export(capsys, other, "--out", good)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        f"nemo-ac export: checkpoint {other}: its tensors do not fit the model of the recipe in its "
        "nemo_ac_checkpoint.json: 'model.model.embed_tokens.weight': checkpoint shape (64, 64), model shape (262, 64)"
    ), lines[0]
    assert tree(good) == exported and sorted(p.name for p in tmp_path.iterdir()) == ["good", "other", "run"]


def test_a_write_that_fails_midway_leaves_the_earlier_export_and_no_partial(run_dir, tmp_path) -> None:
    """A full disk during the second export (a 512 KiB tmpfs holds one 330 KiB export, not two): the export that
    was there stays byte for byte, the half-written ``.hf.partial`` is removed, one line, exit 2."""
    if not _unshare_works():
        pytest.skip("needs unshare -rm (a small tmpfs of its own) to fill a disk")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = """
    import hashlib, json, os, sys
    from pathlib import Path
    from nemo_ac.cli import main
    out = Path(sys.argv[2]) / "hf"
    tree = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())}
    first = main(["export", sys.argv[1], "--out", str(out)])
    before = tree()
    second = main(["export", sys.argv[1], "--out", str(out)])
    print(json.dumps({"codes": [first, second], "same": tree() == before, "beside": sorted(os.listdir(sys.argv[2]))}))
    """.replace("sys.argv[2]", repr(str(disk)))
    proc = _in_namespace(f"mount -t tmpfs -o size=512k tmpfs {disk}", script, run_dir)
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result == {"codes": [0, 2], "same": True, "beside": ["hf"]}, (result, proc.stderr)
    (line,) = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith(f"nemo-ac export: --out {disk / 'hf'}: writing the export failed (") and line.endswith(
        "; the previous content is unchanged"
    ), line
    assert "No space left on device" in line


def _our_processes(cache: Path) -> list[str]:
    """Processes still running with this test's inductor cache in their environment (ranks, compile workers)."""
    psutil = pytest.importorskip("psutil")
    left = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("TORCHINDUCTOR_CACHE_DIR") == str(cache) and proc.status() != psutil.STATUS_ZOMBIE:
                left.append(" ".join(proc.info["cmdline"] or [])[:120])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return left


def test_sigterm_while_a_step_compiles_ends_every_rank_within_the_deadline_with_one_line(run_dir, tmp_path) -> None:
    """``nemo-ac train`` on 2 ranks resumes step_2 of the trained run (its own copy) with compile on and a cold
    inductor cache, so step 3 compiles for much longer than the deadline; SIGTERM to the launcher once inductor
    writes its first file. Every rank ends within the deadline plus start-of-exit slack, rank 0 alone says where it
    was and which checkpoint stands, nothing else is printed, nothing partial is left, no process outlives it."""
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(run_dir / "checkpoints", ckpt)
    cache = tmp_path / "inductor"
    deadline = 5
    command = [sys.executable, "-m", "nemo_ac.cli", "train", str(TINY), "--nproc-per-node", "2"]
    command += [f"logging.run_dir={tmp_path / 'run'}", "logging.progress_bar=never", "compile.enabled=true"]
    command += ["train.steps=4", "train.warmup_steps=1", "checkpoint.enabled=true", "checkpoint.resume=auto"]
    command += [f"checkpoint.dir={ckpt}", f"train.stop_deadline_s={deadline}"]
    log = tmp_path / "out.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(
            command, env=child_env({"TORCHINDUCTOR_CACHE_DIR": str(cache)}), cwd=ROOT, stdout=out, stderr=out
        )
        limit = time.monotonic() + 300
        while time.monotonic() < limit and proc.poll() is None:
            started = "compile | the first step compiles" in log.read_text()
            if started and cache.is_dir() and any(p.is_file() for p in cache.rglob("*")):
                break  # inductor is compiling step 3
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    output = log.read_text()
    print(f"SIGTERM while step 3 compiled: exit {proc.returncode} after {took:.1f} s (deadline {deadline} s)")
    assert proc.returncode == 128 + signal.SIGTERM
    assert took < deadline + 10, output[-3000:]  # well inside torchrun's 30 s grace
    stop_lines = [line for line in output.splitlines() if line.startswith("nemo_ac:")]
    assert stop_lines == [
        f"nemo_ac: SIGTERM during step 3 (compiling): still running train.stop_deadline_s={deadline} s after it; "
        f"nothing new saved; the last complete checkpoint is {ckpt / 'step_2'} (rerun the same command to "
        "continue); exiting with 143"
    ], output[-3000:]
    assert output.rstrip().endswith(stop_lines[0])  # the last line: nothing from torchrun or nemo_ac.launch after it
    for absent in ("Traceback", "forcefully exiting", "nemo-ac train:", "SignalException"):
        assert absent not in output, output[-3000:]
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_1", "step_2"]  # no step_3, no .partial
    time.sleep(1)  # a SIGKILLed worker's exit is reaped by init
    assert _our_processes(cache) == []
