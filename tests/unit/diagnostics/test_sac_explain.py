"""The SAC desync explainer: parsing torch's error, classifying the op, and the error raised out of backward."""

from __future__ import annotations

import pytest
import torch

from nemo_ac.diagnostics.sac_explain import (
    SACDesyncError,
    classify_op,
    explain_sac_desync,
    parse_sac_storage_error,
)
from nemo_ac.distributed import activation_checkpointing as ac

# Every test runs on a private copy of torch's SAC_IGNORED_OPS (the real set stays untouched).
pytestmark = pytest.mark.usefixtures("private_sac_ignored_ops")

TAIL = (
    "This can happen if the operations in the checkpointed region are nondeterministic or depend on global state "
    "that changed between forward and backward."
)


def test_parse_both_torch_messages():
    indexed = RuntimeError(
        f"profiler._record_function_enter_new.default invocation index 2 encountered during backward but not found "
        f"in storage. {TAIL}"
    )
    missing = RuntimeError(
        f"fsdp.all_gather_copy_in.default encountered during backward but not found in storage. {TAIL}"
    )
    assert parse_sac_storage_error(indexed) == ("profiler._record_function_enter_new.default", 2)
    assert parse_sac_storage_error(missing) == ("fsdp.all_gather_copy_in.default", None)
    assert parse_sac_storage_error(RuntimeError("CUDA out of memory")) is None
    assert parse_sac_storage_error(ValueError(str(indexed))) is None


@pytest.mark.parametrize(
    ("op", "kind"),
    [
        ("profiler._record_function_exit._RecordFunction", "profiler"),
        ("fsdp.all_gather_copy_in.default", "fsdp"),
        ("c10d._allgather_base_.default", "fsdp"),
        ("aten.empty.memory_format", "fsdp_or_model"),
        ("_c10d_functional.all_to_all_single.default", "collective"),
        ("aten.mm.default", "model"),
    ],
)
def test_classify(op, kind):
    assert classify_op(op).kind == kind


def test_explanation_names_everything():
    cause = RuntimeError(
        f"profiler._record_function_enter_new.default invocation index 4 encountered during backward but not found "
        f"in storage. {TAIL}"
    )
    err = explain_sac_desync(cause, region="model.layers.3", torch_version="2.13.0", workarounds=False)
    assert isinstance(err, SACDesyncError) and isinstance(err, RuntimeError)
    text = str(err)
    for needle in (
        "model.layers.3",
        "profiler._record_function_enter_new.default (invocation index 4)",
        "torch: 2.13.0",
        "profiler op: True",
        "FSDP op: False",
        "activation_checkpointing.workarounds: true",
        str(cause),
    ):
        assert needle in text, (needle, text)
    assert (err.op, err.index, err.region, err.origin.kind) == (
        "profiler._record_function_enter_new.default",
        4,
        "model.layers.3",
        "profiler",
    )
    fsdp = explain_sac_desync(
        RuntimeError(f"fsdp.all_gather_copy_in.default encountered during backward but not found in storage. {TAIL}"),
        region="model.layers.1",
        torch_version="2.13.0",
        workarounds=True,
    )
    assert "FSDP op: True" in str(fsdp) and "install_fsdp_hooks_outside_sac" in fsdp.remedy
    assert explain_sac_desync(RuntimeError("other"), region="r", torch_version="2", workarounds=True) is None


@pytest.mark.parametrize(("extra_op", "name"), [("neg", "aten.neg.default"), ("add", "aten.add.Tensor")])
def test_desync_inside_a_region_raises_the_explained_error(extra_op, name):
    """Global state that changes between forward and backward (here a flag) makes the recompute run one more op:
    a new op (neg: no index) or one more call of a known op (add: invocation index 1). Both save no tensors, so
    checkpoint's early stop does not end the recompute before they dispatch."""
    state = {"extra": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() + 1.0
        if state["extra"]:
            y = -y if extra_op == "neg" else y + 1.0
        return y.exp()

    x = torch.randn(4, requires_grad=True)
    context_fn = ac.make_selective_checkpoint_context_fn(region="model.layers.5")
    out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, context_fn=context_fn)
    state["extra"] = True
    with pytest.raises(SACDesyncError) as info:
        out.sum().backward()
    err = info.value
    assert err.region == "model.layers.5" and err.origin.kind == "model"
    assert err.op == name
    assert err.index == (None if extra_op == "neg" else 1)
    assert isinstance(err.__cause__, RuntimeError) and "not found in storage" in str(err.__cause__)
    assert "mode: full" in err.remedy


def test_other_errors_in_recompute_pass_through_unchanged():
    state = {"fail": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        if state["fail"]:
            raise ValueError("boom in recompute")
        return x.sin().exp()

    x = torch.randn(4, requires_grad=True)
    out = torch.utils.checkpoint.checkpoint(
        fn, x, use_reentrant=False, context_fn=ac.make_selective_checkpoint_context_fn()
    )
    state["fail"] = True
    with pytest.raises(ValueError, match="boom in recompute"):
        out.sum().backward()
