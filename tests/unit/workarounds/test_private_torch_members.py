"""The private-torch boundary, for what a dotted name cannot show: private members of torch objects (``mesh._flatten``,
``getattr(block, "_checkpoint_wrapped_module")``, ``op._schema``) and writes to a torch module's state
(``torch.utils.checkpoint.SAC_IGNORED_OPS = ...``). ``test_private_torch_boundary`` resolves names rooted at a torch
import; a method called on a DeviceMesh or an attribute read off a wrapper is rooted at a local variable, so it needs
the names themselves.

The private member names are read off torch, not written here: every single-underscore name of the torch classes
whose objects nemo_ac handles (tensors, modules, device meshes, the checkpoint wrapper, FSDP2 and DTensor, op
overloads and custom ops, optimizers, process groups), on the class and on an instance. A use of one outside
``nemo_ac/workarounds`` passes only where ``ALLOWED_MEMBERS`` names it with the reason, or where the same module
defines that name itself (a nemo_ac class's own ``self._handle``).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from tests.factories import hits_outside_workarounds

# Private torch members used outside workarounds/, each with the reason it stays there. An entry no module uses any
# more fails ``test_every_allowed_member_is_used``.
ALLOWED_MEMBERS: dict[str, str] = {
    "_flatten": "DeviceMesh._flatten: how a flattened dimension (dp over dp_replicate x dp_shard) is named, the one "
    "way FSDP2 and torchtitan's meshes get one; no public alias in torch 2.12-2.15 (nemo_ac/distributed/mesh.py)",
    "_unflatten": "DeviceMesh._unflatten: the split of one dimension into named ones (dp_shard_cp -> dp_shard, cp), "
    "the inverse torchtitan uses beside _flatten; same reason",
    "_checkpoint_wrapped_module": "where torch's CheckpointWrapper keeps the wrapped module (its own forward and "
    "state-dict hooks read it); CheckpointWrapper has no public accessor (nemo_ac/distributed/blocks.py)",
    "_schema": "OpOverload._schema: an op's schema (which arguments it mutates), as torch's own dispatch modes read it "
    "(torch.utils._python_dispatch, FakeTensorMode); no public accessor",
    "_name": "CustomOpDef._name: the qualified name of an op made with torch.library.custom_op, to look it up in "
    "torch.ops (nemo_ac/distributed/expert_parallel/deepep_ops.py); no public accessor",
    "_base": "Tensor._base: the tensor a view was made from (offloading leaves views of parameters in place); no "
    "public accessor",
    "_buffers": "nn.Module._buffers: a module's own buffers in registration order, None slots included, which "
    "named_buffers drops (the HF writer and init)",
    "_non_persistent_buffers_set": "nn.Module's record of the buffers state_dict leaves out; the HF writer follows "
    "state_dict's rule with it; no public accessor",
    "SAC_IGNORED_OPS (write)": "the doctor swaps torch.utils.checkpoint.SAC_IGNORED_OPS for a private copy for one "
    "probe and restores it (nemo_ac/doctor/isolation.py), so a probe sees torch as shipped and the real set is "
    "never touched",
}


@functools.cache
def torch_private_members() -> frozenset[str]:
    """Single-underscore member names of the torch objects nemo_ac handles, on the class and on an instance."""
    module = nn.Linear(2, 2)
    custom = torch.library.custom_op("nemo_ac_boundary_probe::identity", mutates_args=())(_identity)
    objects: list[object] = [
        torch.Tensor, torch.ones(1), nn.Module, nn.Parameter, module, CheckpointWrapper(nn.Linear(2, 2)), DeviceMesh,
        FSDPModule, DTensor, torch.ops.aten.add, torch.ops.aten.add.Tensor, custom, torch.optim.Optimizer,
        torch.optim.SGD(module.parameters(), lr=0.1), torch.distributed.ProcessGroup, torch.autograd.Function,
    ]  # fmt: skip
    names: set[str] = set()
    for obj in objects:
        names.update(dir(obj))
        names.update(getattr(obj, "__dict__", {}))
    return frozenset(name for name in names if name.startswith("_") and not name.startswith("__"))


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


def _defined_here(tree: ast.AST) -> set[str]:
    """Names the module defines itself (functions, classes, assigned attributes): its own, not torch's."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def _torch_module_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to a torch module (``import torch.utils.checkpoint as c``, ``from torch.utils import x``)."""
    aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or "torch" for a in node.names if a.name.split(".")[0] == "torch")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            aliases.update(a.asname or a.name for a in node.names if a.name.islower())
    return aliases


def private_member_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of each private torch member read or called in ``path``, and each write to a torch module's
    attribute (``name (write)``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    private = torch_private_members() - _defined_here(tree)
    modules = _torch_module_aliases(tree)
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in private:
            found.add((node.lineno, node.attr))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in private
        ):
            found.add((node.lineno, node.args[1].value))
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in modules
                ):
                    found.add((node.lineno, f"{target.attr} (write)"))
    return sorted(found)


@functools.cache
def member_uses_outside_the_boundary() -> tuple[tuple[str, int, str], ...]:
    return hits_outside_workarounds(private_member_uses)


def test_no_private_torch_member_outside_workarounds() -> None:
    offenders = [
        f"{path}:{line}: {name}"
        for path, line, name in member_uses_outside_the_boundary()
        if name not in ALLOWED_MEMBERS
    ]
    assert not offenders, (
        "private torch members or torch module writes outside nemo_ac/workarounds (move the use behind one function "
        "of a workarounds module, or add it to ALLOWED_MEMBERS with the reason):\n" + "\n".join(offenders)
    )


def test_every_allowed_member_is_used() -> None:
    used = {name for _, _, name in member_uses_outside_the_boundary()}
    assert set(ALLOWED_MEMBERS) <= used, f"unused ALLOWED_MEMBERS entries: {sorted(set(ALLOWED_MEMBERS) - used)}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(mesh):\n    return mesh._flatten('dp')\n", [(2, "_flatten")]),
        ("def f(block):\n    return getattr(block, '_checkpoint_wrapped_module', block)\n", [(2, "_checkpoint_wrapped_module")]),
        ("def f(op):\n    return op._schema.is_mutable\n", [(2, "_schema")]),
        ("import torch.utils.checkpoint as c\nc.SAC_IGNORED_OPS = set()\n", [(2, "SAC_IGNORED_OPS (write)")]),
        ("class Stop:\n    def __init__(self):\n        self._handle = None\n    def f(self):\n        return self._handle\n", []),
        ("def f(mesh):\n    return mesh.get_group(), mesh.size()\n", []),
    ],
    ids=["method", "getattr", "attribute", "module_write", "own_name", "public"],
)  # fmt: skip
def test_the_rule_finds_member_uses(tmp_path: Path, source: str, expected: list[tuple[int, str]]) -> None:
    """Each way code reaches a private torch member is found; a module's own underscored names and public members
    are not."""
    module = tmp_path / "module.py"
    module.write_text(source)
    assert private_member_uses(module) == expected
