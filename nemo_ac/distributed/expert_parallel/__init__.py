"""Expert parallel: experts sharded over ``ep``, tokens dispatched to their experts' ranks and combined back.

``apply_ep`` turns each MoE layer's expert weights into DTensors ``Shard(0)`` on the ``ep`` mesh (this rank keeps
experts ``[r * E/ep, (r + 1) * E/ep)``) and assigns an expert-parallel dispatcher to ``moe.dispatcher``. FSDP then
shards those DTensors further over ``ep_shard`` (``nemo_ac.distributed.fsdp``); the ep mesh and the expert FSDP mesh
are two dims of one view of the root mesh, as FSDP2 requires of a DTensor parameter.

``AllToAllDispatcher`` (``backend.dispatcher: torch``) works on any backend, gloo included:

1. sort the (token, slot) pairs by global expert id (``sort_by_expert``): rows become destination-rank contiguous;
2. exchange the per-expert counts (an all-to-all of ``[ep, E_local]`` ints), then move the rows with a
   differentiable ``all_to_all_single`` with uneven split sizes (gloo rejects the list form with uneven sizes);
3. the received rows are (source rank, local expert) ordered: a stable sort by local expert makes them expert
   contiguous for ``GroupedExperts``; combine undoes both permutations and the all-to-all, then weights.

The differentiable all-to-all is torch's functional-collective autograd op, so its backward is the reverse
all-to-all and torch.compile can trace it (a graph node, not a Python call on a process group).
``backend.dispatcher: deepep`` is this package's ``deepep_dispatcher`` (CUDA only, imported lazily); its communication
runs in the custom ops of ``deepep_ops``. Expert parallel is a package like activation checkpointing and context
parallel: what ``apply_ep`` installs lives beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nemo_ac.distributed.blocks import decoder_layers, routed_moe
from nemo_ac.distributed.plan import ParallelPlan
from nemo_ac.models.kernels.dispatch import (
    TwoPhaseDispatch,
    permute_tokens,
    sort_by_expert,
    unpermute_tokens,
    weighted_combine,
)
from nemo_ac.workarounds.shared_group_names import shared_group_name


def all_to_all_rows(
    rows: torch.Tensor, *, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup | str
) -> torch.Tensor:
    """Differentiable all-to-all over dim 0 with uneven split sizes; backward sends gradients the reverse way."""
    return funcol.all_to_all_single_autograd(rows.contiguous(), output_splits, input_splits, group)


def source_major_to_expert_major(
    recv_counts: torch.Tensor, *, total_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order that makes received rows contiguous per local expert.

    recv_counts: [ep, E_local] rows received from each source rank for each local expert; the received buffer holds
    them source-major (all of rank 0's rows, expert by expert, then rank 1's, ...). Returns ``(order,
    tokens_per_local_expert)`` with ``received[order]`` expert-major; within an expert rows keep source order.
    A stable sort of each row's local expert id. ``total_rows`` (the received row count, already known from the
    split sizes) spares ``repeat_interleave`` its own device-to-host sync and gives it a static output size.
    """
    ep, num_local = recv_counts.shape
    segment_expert = torch.arange(num_local, device=recv_counts.device).repeat(ep)
    flat_counts = recv_counts.reshape(-1)
    row_expert = torch.repeat_interleave(segment_expert, flat_counts, output_size=total_rows)
    return sort_by_expert(row_expert, num_local)


@dataclass
class EPDispatchContext:
    """What ``combine`` needs to undo ``dispatch``."""

    order: torch.Tensor  # local (token, slot) pairs -> global-expert order (sent rows)
    local_order: torch.Tensor  # received rows -> local-expert order
    send_splits: list[int]
    recv_splits: list[int]


@dataclass
class PendingAllToAll:
    """A dispatch whose rows are on their way: the all-to-all's output (an ``AsyncCollectiveTensor`` in eager, which
    waits when first read) and what the finish needs."""

    received: torch.Tensor
    tokens_per_local_expert: torch.Tensor
    ctx: EPDispatchContext


class AllToAllDispatcher(TwoPhaseDispatch):
    """Expert-parallel dispatcher over a process group of ``ep`` ranks (rank r owns experts r*E_l ... r*E_l+E_l-1).

    ``collective_group``: what the functional collectives are given for ``group`` (default ``group`` itself); a
    name that is the same on every rank (``workarounds.shared_group_names``) makes compiled graphs rank-independent.
    """

    def __init__(
        self, *, group: dist.ProcessGroup, num_experts: int, collective_group: dist.ProcessGroup | str | None = None
    ) -> None:
        self.group = group
        self.collective_group = collective_group if collective_group is not None else group
        self.ep_size = dist.get_world_size(group)
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the ep group size {self.ep_size}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def _exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[E] counts this rank sends per global expert -> [ep, E_local] counts it receives per source rank."""
        received = funcol.all_to_all_single(counts, None, None, self.collective_group)
        return received.view(self.ep_size, self.num_local_experts)

    def split_sizes(self, counts: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        """(rows sent to each ep rank, rows received from each) as Python ints, which the all-to-all needs: the one
        host sync of a dispatch, for both lists at once. ``counts``: [E] rows this rank sends per global expert;
        ``recv_counts``: [ep, E_local] rows it receives. The dry run (``nemo_ac.simulate``) answers this from its
        routing assumption instead, the only data-dependent size of the dispatch."""
        splits = torch.stack((counts.view(self.ep_size, -1).sum(1), recv_counts.sum(1))).tolist()
        return splits[0], splits[1]

    def dispatch_start(
        self,
        hidden: torch.Tensor,
        top_idx: torch.Tensor,
        num_experts: int,
        top_scores: torch.Tensor | None = None,
    ) -> PendingAllToAll:
        if num_experts != self.num_experts:
            raise ValueError(f"dispatcher built for {self.num_experts} experts, called with {num_experts}")
        order, counts = sort_by_expert(top_idx, num_experts)
        rows = permute_tokens(hidden, order, top_idx.shape[-1])
        recv_counts = self._exchange_counts(counts)
        send_splits, recv_splits = self.split_sizes(counts, recv_counts)
        received = all_to_all_rows(
            rows, output_splits=recv_splits, input_splits=send_splits, group=self.collective_group
        )
        local_order, tokens_per_local_expert = source_major_to_expert_major(recv_counts, total_rows=sum(recv_splits))
        ctx = EPDispatchContext(order=order, local_order=local_order, send_splits=send_splits, recv_splits=recv_splits)
        return PendingAllToAll(received=received, tokens_per_local_expert=tokens_per_local_expert, ctx=ctx)

    def dispatch_finish(self, pending: PendingAllToAll) -> tuple[torch.Tensor, torch.Tensor, EPDispatchContext]:
        rows = pending.received.index_select(0, pending.ctx.local_order)
        return rows, pending.tokens_per_local_expert, pending.ctx

    def combine(self, expert_out: torch.Tensor, top_scores: torch.Tensor, ctx: EPDispatchContext) -> torch.Tensor:
        source_major = unpermute_tokens(expert_out, ctx.local_order)
        returned = all_to_all_rows(
            source_major, output_splits=ctx.send_splits, input_splits=ctx.recv_splits, group=self.collective_group
        )
        return weighted_combine(unpermute_tokens(returned, ctx.order), top_scores)


def shard_experts(experts: nn.Module, *, ep_mesh: DeviceMesh) -> None:
    """Replace each expert weight [E, ...] by a DTensor ``Shard(0)`` on ``ep_mesh`` (meta tensors stay meta).

    ``src_data_rank=None``: no communication, each rank keeps its slice of whatever it holds; real values come later
    from ``materialize_and_init``, which cuts the same slices from the full, seeded tensor.
    """
    for name, param in list(experts.named_parameters(recurse=False)):
        if isinstance(param, DTensor):
            raise ValueError(f"expert weight {name!r} is already a DTensor; apply_ep must run before fully_shard")
        if param.shape[0] % ep_mesh.size():
            raise ValueError(
                f"expert weight {name!r} has {param.shape[0]} experts, not divisible by ep={ep_mesh.size()}"
            )
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def build_dispatcher(
    kind: str,
    *,
    ep_mesh: DeviceMesh,
    num_experts: int,
    deepep_between_graphs: bool = True,
    deepep_buffer_cls: type | None = None,
    shared_group_names: bool = False,
):
    """The dispatcher for ``backend.dispatcher``; deepep is imported only when asked for.

    Dispatchers keep no per-call state (``dispatch`` returns it as ``ctx``), so one instance serves every layer.
    deepep_buffer_cls: the ``deep_ep.Buffer`` implementation (None: DeepEP's own; tests pass the gloo stand-in).
    shared_group_names: the torch dispatcher's collectives address this rank's EP group by a name that is the same on
    every rank (``workarounds.shared_group_names``), so its compiled graphs are equal across EP groups.
    """
    if kind == "torch":
        group = ep_mesh.get_group()
        collective_group = shared_group_name(group, role="ep") if shared_group_names else None
        return AllToAllDispatcher(group=group, num_experts=num_experts, collective_group=collective_group)
    if kind == "deepep":
        from nemo_ac.distributed.expert_parallel.deepep_dispatcher import DeepEPDispatcher

        return DeepEPDispatcher(
            group=ep_mesh.get_group(),
            num_experts=num_experts,
            between_compiled_graphs=deepep_between_graphs,
            buffer_cls=deepep_buffer_cls,
        )
    raise ValueError(f"backend.dispatcher: unknown dispatcher {kind!r}; use torch or deepep")


def apply_ep(
    model: nn.Module, *, plan: ParallelPlan, ep_mesh: DeviceMesh | None, deepep_buffer_cls: type | None = None
) -> None:
    """Shard every routed MoE's experts over ``ep_mesh`` and give it the plan's expert-parallel dispatcher.

    ``plan.ep`` 1: nothing to do; the local dispatcher stays (the plan has refused any other dispatcher without
    expert parallel: ``config.deepep.dispatcher_ep_issue``). ``deepep_buffer_cls``: see ``build_dispatcher``.
    """
    if plan.ep == 1:
        return
    if ep_mesh is None:
        raise ValueError(f"the plan shards experts over {plan.ep} ranks, but no expert-parallel mesh was given")
    moes = [moe for block in decoder_layers(model) if (moe := routed_moe(block)) is not None]
    if not moes:
        return
    num_experts = {moe.experts_module().num_experts for moe in moes}
    if len(num_experts) != 1:
        raise ValueError(f"MoE layers disagree on the number of experts: {sorted(num_experts)}")
    shared = build_dispatcher(
        plan.kernels.dispatcher.value,
        ep_mesh=ep_mesh,
        num_experts=num_experts.pop(),
        deepep_between_graphs=plan.dispatcher_between_graphs(),
        deepep_buffer_cls=deepep_buffer_cls,
        shared_group_names=plan.collectives_by_mesh_dim(),
    )
    for moe in moes:
        shard_experts(moe.experts_module(), ep_mesh=ep_mesh)
        moe.set_dispatcher(shared)
