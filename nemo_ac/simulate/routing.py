"""The routing assumption of a dry run: how many rows each expert gets, since fake tensors hold no router scores.

Under FakeTensorMode the router's expert choice has no values, so the one data-dependent size of an expert-parallel
dispatch (the rows sent to and received from each ep rank: ``AllToAllDispatcher.split_sizes``) comes from here:

- ``imbalance == 1`` (default): every expert gets the rows round robin (token t, slot j -> expert (t*k + j) mod E),
  what ``model.moe.force_balanced_routing`` makes a real run do, so a real run and its dry run move the same bytes;
- ``imbalance F > 1``: the busiest expert gets F times the mean load from every source rank, the others share the
  rest evenly; the busiest expert lives on the simulated rank (its receive side is the worst case).

Every source rank is assumed to route the same number of rows the same way (packed rows of equal length).
DeepEP's dispatch gets the same counts (its stand-in is this dispatcher); what it puts on the wire differs
(``deepep_copies``): one copy of a token per destination rank (not per expert) over NVLink, and across nodes one per
destination node over RDMA, forwarded over NVLink inside that node. Its destinations are the round robin's (token t
goes to experts t*k .. t*k + k - 1 mod E, as NeMo Automodel's ``FakeBalancedGate`` routes), whatever the imbalance. Routing without expert parallel has no
data-dependent size: the grouped GEMMs' shapes are the row count whatever the split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.distributed.blocks import decoder_layers, routed_moe
from nemo_ac.distributed.expert_parallel import AllToAllDispatcher, PendingAllToAll


@dataclass(frozen=True)
class RoutingAssumption:
    """The busiest expert's load over the mean load (1: balanced)."""

    imbalance: float = 1.0

    def describe(self) -> str:
        if self.imbalance == 1.0:
            return "routed tokens balanced across experts (round robin, as model.moe.force_balanced_routing)"
        return (
            f"the busiest expert gets {self.imbalance:g}x the mean load from every rank and sits on the simulated "
            "rank; the other experts share the rest evenly"
        )

    def check(self, *, num_experts: int, top_k: int) -> None:
        """An expert can take at most every token once: ``F <= E / k``."""
        most = num_experts / top_k
        if not 1.0 <= self.imbalance <= most:
            raise ConfigError(
                ConfigIssue(
                    "--imbalance",
                    f"{self.imbalance:g} is outside [1, num_experts / top_k = {most:g}] (1: balanced; F: the busiest "
                    "expert's load over the mean)",
                )
            )

    def expert_counts(self, rows: int, num_experts: int) -> list[int]:
        """Rows per global expert that one source rank sends (``rows`` = its tokens x top_k)."""
        base, extra = divmod(rows, num_experts)
        balanced = [base + (1 if e < extra else 0) for e in range(num_experts)]
        if self.imbalance == 1.0 or num_experts == 1:
            return balanced
        hot = min(rows, max(balanced[0], round(self.imbalance * rows / num_experts)))
        rest_base, rest_extra = divmod(rows - hot, num_experts - 1)
        return [hot] + [rest_base + (1 if e < rest_extra else 0) for e in range(num_experts - 1)]


@dataclass(frozen=True)
class DeepEPCopies:
    """What DeepEP sends for each (token, expert) row that another rank of the EP group needs: ``per_rank`` copies
    over NVLink (one per destination rank) and ``per_node`` over RDMA (one per destination node), both <= 1."""

    per_rank: float
    per_node: float


@dataclass(frozen=True)
class DeepEPRouting:
    """The dispatch DeepEP stands in for: tokens per micro batch on this rank, top-k, experts. ``async_dispatch``:
    the forward's dispatch is DeepEP's ``async_finish`` (the plan calls the ops between compiled graphs:
    ``DeepEPDispatcher``), so the transfer runs behind the compute issued before its rows are first read."""

    tokens: int
    top_k: int
    num_experts: int
    async_dispatch: bool = False

    def copies(self, *, group_ranks: tuple[int, ...], rank_in_group: int, gpus_per_node: int) -> DeepEPCopies:
        return deepep_copies(
            tokens=self.tokens,
            top_k=self.top_k,
            num_experts=self.num_experts,
            group_ranks=group_ranks,
            rank_in_group=rank_in_group,
            gpus_per_node=gpus_per_node,
        )


@functools.lru_cache(maxsize=64)
def deepep_copies(
    *, tokens: int, top_k: int, num_experts: int, group_ranks: tuple[int, ...], rank_in_group: int, gpus_per_node: int
) -> DeepEPCopies:
    """Over the round robin's destinations (module docstring): remote rows, distinct remote ranks and distinct
    remote nodes per token, summed over ``tokens`` tokens of the rank at ``rank_in_group`` of ``group_ranks``."""
    local = num_experts // len(group_ranks)
    node_of = [rank // gpus_per_node for rank in group_ranks]
    own_node = node_of[rank_in_group]
    rows = ranks = nodes = 0
    for token in range(tokens):
        slots = [(token * top_k + slot) % num_experts // local for slot in range(top_k)]
        remote = {r for r in slots if r != rank_in_group}
        rows += sum(1 for r in slots if r != rank_in_group)
        ranks += len(remote)
        nodes += len({node_of[r] for r in remote} - {own_node})
    if rows == 0:
        return DeepEPCopies(per_rank=1.0, per_node=1.0)
    return DeepEPCopies(per_rank=ranks / rows, per_node=nodes / rows)


class AssumedSplitsDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` whose split sizes come from a ``RoutingAssumption`` instead of the router's counts
    (the only override: sorting, permutation, the count exchange and both all-to-alls run as in training)."""

    def __init__(
        self, *, inner: AllToAllDispatcher, assumption: RoutingAssumption, rank: int, async_dispatch: bool = False
    ) -> None:
        super().__init__(group=inner.group, num_experts=inner.num_experts, collective_group=inner.collective_group)
        self.assumption = assumption
        self.rank = rank
        # Standing in for DeepEP's asynchronous dispatch: MoE.forward then orders its shared expert as it would.
        self.async_dispatch = async_dispatch
        self._rows = 0  # (token, slot) rows of the dispatch in progress

    def split_sizes(self, counts: torch.Tensor, recv_counts: torch.Tensor) -> tuple[list[int], list[int]]:
        per_expert = self.assumption.expert_counts(self._rows, self.num_experts)
        local = self.num_local_experts
        send = [sum(per_expert[r * local : (r + 1) * local]) for r in range(self.ep_size)]
        # Every source routes like this rank; expert 0 (the hot one) belongs to ep rank 0.
        mine = sum(per_expert[self.rank * local : (self.rank + 1) * local])
        return send, [mine] * self.ep_size

    def dispatch_start(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> PendingAllToAll:
        self._rows = top_idx.numel()  # tokens x top_k: a shape, known under fake tensors
        return super().dispatch_start(hidden, top_idx, num_experts, top_scores=top_scores)


def install_assumed_routing(
    model: nn.Module, *, assumption: RoutingAssumption, ep_rank: int, async_dispatch: bool = False
) -> int:
    """Give every expert-parallel MoE layer the assumption's split sizes; returns how many layers use it.
    ``async_dispatch``: the dispatcher stands in for one whose dispatch is asynchronous (DeepEP between graphs)."""
    installed = 0
    replaced: dict[int, AssumedSplitsDispatcher] = {}
    for block in decoder_layers(model):
        moe = routed_moe(block)
        if moe is None or not isinstance(moe.dispatcher, AllToAllDispatcher):
            continue
        inner = moe.dispatcher
        if id(inner) not in replaced:
            replaced[id(inner)] = AssumedSplitsDispatcher(
                inner=inner, assumption=assumption, rank=ep_rank, async_dispatch=async_dispatch
            )
        moe.set_dispatcher(replaced[id(inner)])
        installed += 1
    return installed
