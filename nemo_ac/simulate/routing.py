"""The routing assumption of a dry run: how many rows each expert gets, since fake tensors hold no router scores.

Under FakeTensorMode the router's expert choice has no values, so the one data-dependent size of an expert-parallel
dispatch (the rows sent to and received from each ep rank: ``AllToAllDispatcher.split_sizes``) comes from here:

- ``imbalance == 1`` (default): every expert gets the rows round robin (token t, slot j -> expert (t*k + j) mod E),
  what ``model.moe.force_balanced_routing`` makes a real run do, so a real run and its dry run move the same bytes;
- ``imbalance F > 1``: the busiest expert gets F times the mean load from every source rank, the others share the
  rest evenly; the busiest expert lives on the simulated rank (its receive side is the worst case).

Every source rank is assumed to route the same number of rows the same way (packed rows of equal length).
DeepEP runs as in training (``AssumedRoutingDeepEP``: nemo_ac's DeepEP dispatcher and its custom ops on fake
tensors, DeepEP's kernels as the ops' fake impls), with two sizes from here (``deepep_layout``): the tokens a rank
receives, each once however many of its experts a token chose, and the rows of its local experts (the same counts
as above). What DeepEP puts on the wire: a token once per destination rank (not per expert) over NVLink, and across
nodes once per destination node over RDMA, forwarded over NVLink inside that node. Its destinations are the round
robin's (token t goes to experts t*k .. t*k + k - 1 mod E, as NeMo Automodel's ``FakeBalancedGate`` routes),
whatever the imbalance. Routing without expert parallel has no data-dependent size: the grouped GEMMs' shapes are
the row count whatever the split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.distributed.blocks import decoder_layers, routed_moe
from nemo_ac.distributed.expert_parallel import AllToAllDispatcher, PendingAllToAll, deepep_ops
from nemo_ac.distributed.expert_parallel.deepep_dispatcher import DeepEPDispatcher, PendingDeepEP
from nemo_ac.models.kernels.dispatch import TwoPhaseDispatch
from nemo_ac.simulate.gpus import GPUS_PER_NODE


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
class DeepEPRouting:
    """What the counter needs to cost DeepEP's ops: top-k and experts (the round robin's destinations), and
    ``async_dispatch``: DeepEP's transfers are ``async_finish`` (the plan calls the ops between compiled graphs:
    ``DeepEPDispatcher``), so each runs behind the compute issued before its rows are first read."""

    top_k: int
    num_experts: int
    async_dispatch: bool = False

    def destinations(
        self, *, tokens: int, group_ranks: tuple[int, ...], rank_in_group: int, gpus_per_node: int
    ) -> DeepEPDestinations:
        return deepep_destinations(
            tokens=tokens,
            top_k=self.top_k,
            num_experts=self.num_experts,
            group_ranks=group_ranks,
            rank_in_group=rank_in_group,
            gpus_per_node=gpus_per_node,
        )


@dataclass(frozen=True)
class DeepEPDestinations:
    """Where one source rank's tokens go under the round robin (whatever the imbalance, module docstring): how many
    have an expert on the simulated rank, and per token sent, the distinct other ranks and other nodes it reaches."""

    here: int
    remote_ranks_per_token: float
    remote_nodes_per_token: float


@functools.lru_cache(maxsize=64)
def deepep_destinations(
    *, tokens: int, top_k: int, num_experts: int, group_ranks: tuple[int, ...], rank_in_group: int, gpus_per_node: int
) -> DeepEPDestinations:
    local = num_experts // len(group_ranks)
    node_of = [rank // gpus_per_node for rank in group_ranks]
    own_node = node_of[rank_in_group]
    here = ranks = nodes = 0
    for token in range(tokens):
        owners = {(token * top_k + slot) % num_experts // local for slot in range(top_k)}
        here += rank_in_group in owners
        ranks += len(owners - {rank_in_group})
        nodes += len({node_of[r] for r in owners} - {own_node})
    return DeepEPDestinations(
        here=here, remote_ranks_per_token=ranks / max(tokens, 1), remote_nodes_per_token=nodes / max(tokens, 1)
    )


@dataclass(frozen=True)
class DeepEPLayout:
    """One DeepEP dispatch of the dry run, per rank (every source rank routes alike): the tokens this rank receives
    (once each, however many of its experts a token chose), the (token, expert) rows of its local experts, and per
    token sent, the distinct other ranks and other nodes it goes to."""

    received: int
    rows_here: int
    remote_ranks_per_token: float
    remote_nodes_per_token: float


@functools.lru_cache(maxsize=64)
def deepep_layout(
    *,
    tokens: int,
    top_k: int,
    num_experts: int,
    group_ranks: tuple[int, ...],
    rank_in_group: int,
    gpus_per_node: int,
    assumption: RoutingAssumption,
) -> DeepEPLayout:
    """``deepep_destinations`` for what goes where; the assumption's counts for the rows of the local experts. A
    busier expert here receives more tokens too: at least its rows, from each source."""
    where = deepep_destinations(
        tokens=tokens,
        top_k=top_k,
        num_experts=num_experts,
        group_ranks=group_ranks,
        rank_in_group=rank_in_group,
        gpus_per_node=gpus_per_node,
    )
    local = num_experts // len(group_ranks)
    per_expert = assumption.expert_counts(tokens * top_k, num_experts)[
        rank_in_group * local : (rank_in_group + 1) * local
    ]
    from_each = min(tokens, max(where.here, max(per_expert, default=0)))
    return DeepEPLayout(
        received=from_each * len(group_ranks),
        rows_here=sum(per_expert) * len(group_ranks),
        remote_ranks_per_token=where.remote_ranks_per_token,
        remote_nodes_per_token=where.remote_nodes_per_token,
    )


class NoDeepEPKernels:
    """The dry run's ``deep_ep.Buffer``: never made. Under fake tensors DeepEP's ops run their fake impls only."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the dry run runs no DeepEP kernel: a DeepEP op ran outside fake tensors")


class AssumedRoutingDeepEP(DeepEPDispatcher):
    """The recipe's own DeepEP dispatcher in the dry run: its expert-side permutation, weighting and combine, and the
    ``nemo_ac::deepep_*`` ops that selective AC saves, run as in training on fake tensors. DeepEP's kernels do not
    run (the ops' fake impls), so the two data-dependent sizes come from the routing assumption (``deepep_layout``):
    the tokens this rank receives and the rows of its local experts."""

    def __init__(
        self, *, group: dist.ProcessGroup, num_experts: int, assumption: RoutingAssumption, async_dispatch: bool
    ) -> None:
        super().__init__(
            group=group, num_experts=num_experts, between_compiled_graphs=async_dispatch, buffer_cls=NoDeepEPKernels
        )
        self.assumption = assumption
        self._rows_here = 0

    def layout(self, *, tokens: int, top_k: int) -> DeepEPLayout:
        return deepep_layout(
            tokens=tokens,
            top_k=top_k,
            num_experts=self.num_experts,
            group_ranks=tuple(dist.get_process_group_ranks(self.group)),
            rank_in_group=dist.get_rank(self.group),
            gpus_per_node=GPUS_PER_NODE,
            assumption=self.assumption,
        )

    def dispatch_start(
        self, hidden: torch.Tensor, top_idx: torch.Tensor, num_experts: int, top_scores: torch.Tensor | None = None
    ) -> PendingDeepEP:
        layout = self.layout(tokens=top_idx.shape[0], top_k=top_idx.shape[1])
        deepep_ops.assume_received_rows(self.buffers_key, layout.received)
        self._rows_here = layout.rows_here
        return super().dispatch_start(hidden, top_idx, num_experts, top_scores=top_scores)

    def rows_here(self, tokens_per_expert: torch.Tensor) -> int:
        return self._rows_here


class AssumedSplitsDispatcher(AllToAllDispatcher):
    """``AllToAllDispatcher`` whose split sizes come from a ``RoutingAssumption`` instead of the router's counts
    (the only override: sorting, permutation, the count exchange and both all-to-alls run as in training)."""

    def __init__(self, *, inner: AllToAllDispatcher, assumption: RoutingAssumption, rank: int) -> None:
        super().__init__(group=inner.group, num_experts=inner.num_experts, collective_group=inner.collective_group)
        self.assumption = assumption
        self.rank = rank
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
    """Give every expert-parallel MoE layer the assumption's sizes (the all-to-all dispatcher's split sizes, DeepEP's
    received tokens and local rows); returns how many layers use it. ``async_dispatch``: DeepEP's transfers
    are asynchronous in the planned run (between compiled graphs; the dry run itself compiles nothing)."""
    installed = 0
    replaced: dict[int, TwoPhaseDispatch] = {}
    for block in decoder_layers(model):
        moe = routed_moe(block)
        if moe is None or not isinstance(moe.dispatcher, (AllToAllDispatcher, DeepEPDispatcher)):
            continue
        inner = moe.dispatcher
        if id(inner) not in replaced:
            if isinstance(inner, DeepEPDispatcher):
                replaced[id(inner)] = AssumedRoutingDeepEP(
                    group=inner.group,
                    num_experts=inner.num_experts,
                    assumption=assumption,
                    async_dispatch=async_dispatch,
                )
            else:
                replaced[id(inner)] = AssumedSplitsDispatcher(inner=inner, assumption=assumption, rank=ep_rank)
        moe.set_dispatcher(replaced[id(inner)])
        installed += 1
    return installed
