"""One private-torch boundary: every use of a private torch API sits in ``nemo_ac/workarounds``.

Every module of nemo_ac outside ``workarounds/`` is parsed with ``ast`` (comments and docstrings do not count) and
each dotted name that reaches torch is resolved through the module's imports (``import torch.x as y``, ``from torch.x
import y``); a name with a component that starts with one underscore (``torch._dynamo``, ``torch.utils._pytree``,
``torch.ops.aten._grouped_mm``; dunders such as ``torch.__version__`` are public) is a private use, and so are
``getattr`` / ``hasattr`` with such a name on a torch object and the ``_torch*`` markers torch leaves on user
objects (``fn._torchdynamo_disable``). A private use passes only where ``ALLOWED`` names it, with the reason torch
treats it as supported surface. Everything else moves into a module of the workarounds kind (what it relies on, the
torch versions checked, when to delete) behind one small function, with a registry row the doctor checks.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.factories import hits_outside_workarounds

# Underscored torch names that torch itself treats as supported surface: each used outside workarounds/ for the
# reason given. Short on purpose; an entry no module uses any more fails ``test_every_allowlist_entry_is_used``.
ALLOWED: dict[str, str] = {
    "torch.distributed._functional_collectives": "the traceable collectives DTensor and torchtitan's expert and "
    "context parallel call; torch.distributed's docs point torch.compile users to them",
    "torch.ops._c10d_functional": "the op namespace _functional_collectives dispatches to: the dry run counts those "
    "ops by identity, as torch's own comm mode (torch.distributed.tensor.debug.CommDebugMode) does",
    "torch.ops._c10d_functional_autograd": "the autograd variants of the same collectives (same reason)",
    "torch.utils._pytree": "torch's pytree registry: register_dataclass is how torch.export and torch.compile are "
    "told about output dataclasses (documented in torch.export)",
    "torch.utils._python_dispatch.is_in_any_mode_without_ignore_compile_internals": "the flag Dynamo itself reads to "
    "skip frames under a dispatch mode: where it is set FlexAttention cannot run and the tiled op stands in",
    "torch.utils._python_dispatch.is_in_torch_dispatch_mode": "the same module's check for any active dispatch "
    "mode: FlexAttention reuses its block mask only outside one (selective AC's modes hand saved outputs back in "
    "order, so the recompute must run the ops the forward ran)",
    "torch.utils._python_dispatch.TorchDispatchMode": "the base class torch documents for __torch_dispatch__ modes "
    "(FlopCounterMode and the memory trackers derive from it)",
    "torch._grouped_mm": "the grouped GEMM op itself (torchtitan's MoE experts call it); no public alias exists",
    "torch.ops.aten._grouped_mm": "the same op's overload packet, to register its FLOP formula",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper": "checkpoint_wrapper / CheckpointWrapper / "
    "CheckpointImpl: the activation-checkpoint wrapper FSDP2 and torchtitan use; torch has no other module path",
    "torch._foreach_mul_": "a multi-tensor kernel torch.optim and torch.nn.utils.clip_grad_norm_ call themselves "
    "(torch._foreach_* are the documented foreach implementations)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu": "the fused CPU kernel SDPA dispatches to, "
    "called per document span for its log-sum-exp (the ring merges by it; the public SDPA returns none); a "
    "native_functions.yaml op that inductor registers a fallback for (checked here on torch 2.13)",
    "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward": "the same kernel's backward, which SDPA's "
    "autograd calls; the spans call it with the merged output and log-sum-exp (same reason)",
}


def _private_prefix(parts: list[str]) -> str | None:
    for index, part in enumerate(parts[1:], start=1):
        if part.startswith("_") and not (part.startswith("__") and part.endswith("__")):
            return ".".join(parts[: index + 1])
    return None


def _dotted(node: ast.AST) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(parts)]
    return None


def private_torch_uses(path: Path) -> list[tuple[int, str]]:
    """``(line, full dotted name)`` of each private torch use in ``path`` (markers as ``._torch...``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    if _private_prefix(alias.name.split(".")):
                        found.add((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = full
                if _private_prefix(full.split(".")):
                    found.add((node.lineno, full))
    parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}

    def resolve(node: ast.AST) -> list[str] | None:
        parts = _dotted(node)
        if parts is None or parts[0] not in aliases:
            return None
        return aliases[parts[0]].split(".") + parts[1:]

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(parents.get(node), ast.Attribute):
            parts = resolve(node)
            if parts and _private_prefix(parts):
                found.add((node.lineno, ".".join(parts)))
        if isinstance(node, ast.Attribute) and node.attr.startswith("_torch"):
            found.add((node.lineno, f"._{node.attr[1:]}"))
        marker = isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_torch")
        if marker and node.value.isidentifier():
            found.add((node.lineno, f".{node.value}"))
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            parts = resolve(node.args[0])
            if parts and _private_prefix([*parts, node.args[1].value]):
                found.add((node.lineno, ".".join([*parts, node.args[1].value])))
    return sorted(found)


def allowed_by(name: str) -> str | None:
    return next((entry for entry in ALLOWED if name == entry or name.startswith(entry + ".")), None)


@functools.cache
def uses_outside_the_boundary() -> tuple[tuple[str, int, str], ...]:
    """``(module path, line, name)`` of every private torch use in nemo_ac outside ``workarounds/``."""
    return hits_outside_workarounds(private_torch_uses)


def test_no_private_torch_outside_workarounds():
    offenders = [f"{path}:{line}: {name}" for path, line, name in uses_outside_the_boundary() if not allowed_by(name)]
    assert not offenders, (
        "private torch outside nemo_ac/workarounds (move it behind one function of a workarounds module, with a "
        "registry row, or add it to ALLOWED with the reason torch supports it):\n" + "\n".join(offenders)
    )


def test_every_allowlist_entry_is_used():
    used = {allowed_by(name) for _, _, name in uses_outside_the_boundary()} - {None}
    assert set(ALLOWED) == used, f"unused allowlist entries: {sorted(set(ALLOWED) - used)}"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch\ntorch._dynamo.reset()\n", [(2, "torch._dynamo.reset")]),
        ("import torch._dynamo\n", [(1, "torch._dynamo")]),
        (
            "from torch._functorch.partitioners import get_default_op_list\n",
            [(1, "torch._functorch.partitioners.get_default_op_list")],
        ),
        ("import torch.utils.checkpoint as c\nc._private\n", [(2, "torch.utils.checkpoint._private")]),
        (
            "import torch\ngetattr(torch._dynamo, 'callback_handler')\n",
            [(2, "torch._dynamo"), (2, "torch._dynamo.callback_handler")],
        ),
        ("import torch\nhasattr(torch, '_grouped_mm')\n", [(2, "torch._grouped_mm")]),
        ("def f(fn):\n    return getattr(fn, '_torchdynamo_disable', False)\n", [(2, "._torchdynamo_disable")]),
        ("import torch\nprint(torch.__version__, torch.compiler.list_backends())\n", []),
        ('"""torch._dynamo in a docstring"""\n# torch._C in a comment\n', []),
    ],
    ids=["attribute", "import", "from_import", "alias", "getattr_chain", "hasattr_name", "marker", "public", "text"],
)
def test_the_rule_finds_private_uses(tmp_path, source, expected):
    """The rule itself: each way code reaches private torch is found; public names, comments and docstrings not."""
    module = tmp_path / "module.py"
    module.write_text(source)
    assert private_torch_uses(module) == expected
