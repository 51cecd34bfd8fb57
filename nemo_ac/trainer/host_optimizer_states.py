"""AdamW whose moment states live in host memory between steps (``train.optimizer_offload: states``).

AdamW's ``exp_avg`` and ``exp_avg_sq`` are fp32 tensors the size of every trainable parameter a rank holds: 8 bytes
per parameter, the largest single term of every flagship's peak (32.3 GiB of Qwen3.6-35B-A3B's on 8 ranks, 49.8 GiB
of GLM-4.5-Air's on 16). They are read once per step, by the update, so they can wait in host memory through the
forward and backward. Here they do: at ``step()`` the parameters are updated in buckets of about ``bucket_bytes``
of state, each bucket's states copied to the device, updated by torch's own AdamW kernel (``torch.optim.adamw``,
fused or foreach as the device's ``adamw_implementation``), and copied back. The device holds one bucket's states at
a time instead of all of them; the price is moving the states over the host link twice per step (to the device and
back), not overlapped with the update (the dry run puts that time on the step's critical path).

The same class, keys and tensors as ``torch.optim.AdamW``: ``state[p]`` holds ``step``, ``exp_avg`` and
``exp_avg_sq``, with the parameter's shape and placements (a DTensor's local shard on the host), so DCP
checkpoints of either optimizer load into the other, and every element is updated by the same arithmetic: the
result is bitwise the on-device AdamW's (tests/unit/trainer/test_host_optimizer_states.py). Masters and gradients
stay on the device (the lighter lever; FSDP2's ``CPUOffloadPolicy`` moves those too).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw

# Bytes of moment states per device bucket: what the device holds of them during the step.
DEFAULT_BUCKET_BYTES = 2**30
MOMENTS = ("exp_avg", "exp_avg_sq")


def _step_dtype() -> torch.dtype:
    """The dtype torch's AdamW gives a non-fused ``step``: float64 under a float64 default dtype, else float32."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class AdamWHostStates(torch.optim.AdamW):
    """``torch.optim.AdamW`` (no amsgrad, no capturable) with ``exp_avg`` / ``exp_avg_sq`` kept on ``host``.

    ``host``: "cpu" in a run (pinned when the parameters are on CUDA, so the copies are asynchronous DMA); the dry
    run passes "meta" so that the states leave its device accounting (fake tensors have no host memory either).
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        host: str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        fused: bool = False,
        **adamw_options: Any,
    ) -> None:
        if adamw_options.get("amsgrad") or adamw_options.get("capturable"):
            raise ValueError("AdamWHostStates supports neither amsgrad nor capturable")
        super().__init__(params, fused=fused or None, foreach=not fused, **adamw_options)
        self.host = torch.device(host)
        self.bucket_bytes = bucket_bytes

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        devices: set[torch.device] = set()
        for group in self.param_groups:
            bucket: list[torch.Tensor] = []
            size = 0
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                bucket.append(param)
                devices.add(param.device)
                size += 2 * _nbytes(param)
                if size >= self.bucket_bytes:
                    self._step_bucket(group, bucket)
                    bucket, size = [], 0
            if bucket:
                self._step_bucket(group, bucket)
        for device in devices:  # the host copies must be complete before anyone reads them (a checkpoint save)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
        return loss

    def _step_bucket(self, group: dict[str, Any], bucket: list[torch.Tensor]) -> None:
        fused = bool(group["fused"])
        moments: dict[str, list[torch.Tensor]] = {name: [] for name in MOMENTS}
        steps = []
        for param in bucket:
            state = self.state[param]
            if not state:
                state["step"] = (
                    torch.zeros((), dtype=torch.float32, device=param.device)
                    if fused
                    else torch.tensor(0.0, dtype=_step_dtype())
                )
            for name in MOMENTS:
                if name in state:
                    on_device = torch.empty_like(param, memory_format=torch.preserve_format)
                    on_device.copy_(state[name], non_blocking=True)
                else:  # AdamW's first step starts from zeros
                    on_device = torch.zeros_like(param, memory_format=torch.preserve_format)
                moments[name].append(on_device)
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adamw(
            bucket,
            [param.grad for param in bucket],
            moments["exp_avg"],
            moments["exp_avg_sq"],
            [],
            steps,
            foreach=group["foreach"],
            fused=group["fused"],
            capturable=False,
            differentiable=False,
            grad_scale=None,
            found_inf=None,
            has_complex=any(torch.is_complex(param) for param in bucket),
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )
        for index, param in enumerate(bucket):
            state = self.state[param]
            for name in MOMENTS:
                if name not in state:
                    state[name] = self._host_like(param)
                state[name].copy_(moments[name][index], non_blocking=True)

    def _host_like(self, param: torch.Tensor) -> torch.Tensor:
        """An empty host tensor shaped as ``param``; for a DTensor, its local shard on the host wrapped with the
        parameter's mesh and placements (as FSDP2's own CPU offload holds its shards), so that pinning and DCP see
        a plain local tensor."""
        local = param.to_local() if isinstance(param, DTensor) else param
        host = torch.empty_like(local, device=self.host, memory_format=torch.preserve_format)
        if local.device.type == "cuda" and self.host.type == "cpu":
            host = host.pin_memory()  # copies from and to pinned memory are asynchronous DMA
        if not isinstance(param, DTensor):
            return host
        return DTensor.from_local(
            host, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` moves every state to its parameter's device; the moments go back to the
        host (a DCP resume would otherwise keep them on the device from then on, silently)."""
        super().load_state_dict(state_dict)
        for param, state in self.state.items():
            for name in MOMENTS:
                if name in state and state[name].device != self.host:
                    host = self._host_like(param)
                    host.copy_(state[name])
                    state[name] = host

    def host_state_bytes(self) -> int:
        """Bytes of moment states this rank keeps on the host (local shards)."""
        total = 0
        for state in self.state.values():
            for name in MOMENTS:
                value = state.get(name)
                if value is not None:
                    local = value.to_local() if isinstance(value, DTensor) else value
                    total += _nbytes(local)
        return total
