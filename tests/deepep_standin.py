"""``GlooDeepEPBufferStandIn``: a STAND-IN for DeepEP's ``deep_ep.Buffer``, not DeepEP. It implements the Buffer's
documented dispatch / combine semantics with gloo ``all_to_all_single`` (uneven split sizes) so the DeepEP adapter
(``distributed.expert_parallel.deepep_dispatcher`` + ``deepep_ops``) can be tested on CPU: its routing, its gradients
against ``backend.dispatcher: torch``, and how often a recompute communicates. It says nothing about DeepEP's kernels,
speed or memory; those need a multi-GPU run with the real library.

What it relies on (DeepEP at github.com/deepseek-ai/DeepEP: ``deep_ep/buffer.py`` at tag v1.2.1, the same class as
``deep_ep/buffers/legacy.py`` at 2.1.0; its test ``tests/test_intranode.py``, ``tests/legacy/`` in 2.1.0; the
intranode kernels in ``csrc/kernels/intranode.cu``, ``csrc/kernels/legacy/`` in 2.1.0):

- ``get_dispatch_layout(topk_idx, num_experts)`` -> ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank
  (None within a node, [R / 8] int32 across nodes), num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool,
  event)``; ``topk_idx`` -1 means no expert; experts are split contiguously over ranks (``E / R`` each).
- ``dispatch(x, topk_idx=, topk_weights=, num_tokens_per_rank=, num_tokens_per_rdma_rank=, is_token_in_rank=,
  num_tokens_per_expert=)`` -> ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle,
  event)``: a token goes once to every rank in ``is_token_in_rank`` (not once per expert); received rows are ordered
  by source rank, then by source token (the test's ``check_data`` walks ``rank_prefix_matrix[i][rank]``);
  ``recv_topk_idx`` holds local expert ids, -1 for a slot whose expert is on another rank, and
  ``recv_topk_weights`` the slot's weight, 0 where the id is -1 (the kernel: ``idx_value >= 0 ? weight_value :
  0.0f``); the per-expert list is a Python list of this rank's local experts' counts, each rounded up to
  ``expert_alignment``. With ``handle=`` (the cached layout, what the backward of combine uses) ``topk_idx`` and
  ``topk_weights`` must be None and only ``recv_x`` comes back (the other four None).
- ``combine(x, handle, topk_weights=None)`` -> ``(combined_x, combined_topk_weights, event)``: every received row goes
  back to its source token and a token's rows are added, *without* weights (the test divides by
  ``is_token_in_rank.sum(1)``), accumulated in fp32 in rank order and cast to ``x``'s dtype (the kernel's reduce
  loop); ``topk_weights`` are summed the same way (None in, None out).
- ``get_dispatch_config(num_ranks)`` / ``get_combine_config(num_ranks)``: a config only for the rank counts DeepEP
  tabulates (2.1.0: 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160; v1.2.1 lacks 48 and 96), an AssertionError
  otherwise; the configs give buffer size hints.

Deliberate differences: any floating dtype (DeepEP: bf16 tokens, fp8 optional for dispatch), so tests can compare in
fp32 exactly; one rank is accepted too (DeepEP has no 1-rank config), so single-process tests can trace the ops;
synchronous (an ``async_finish`` call's event only logs where the compute stream would wait); size hints are 0 (gloo needs no buffer); no
fp8, bias, low-latency mode, ``num_worst_tokens`` or SM/config tuning (they raise).

It counts its calls in ``calls``, by kind: ``dispatch`` (a new layout from ``topk_idx``) and ``combine`` (no
weights) are what the adapter's forward makes; ``dispatch(handle)`` and ``combine(topk_weights)`` what its backward
makes (combine's and dispatch's backward). A forward-kind call during backward is therefore a recompute
communicating again.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
import torch.distributed as dist

# The rank counts DeepEP's Buffer.get_dispatch_config / get_combine_config have a config for (2.1.0's table).
DEEPEP_CONFIG_RANKS = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
_NVL_PEERS = 8  # DeepEP's internode split: 8 NVLink peers per node


class StandInEvent:
    """DeepEP's ``EventOverlap`` for a synchronous stand-in: waiting does nothing, but an ``async_finish``
    call's event writes ``"wait"`` into the buffer's ``log`` (where the compute stream would wait)."""

    def __init__(self, log: list[str] | None = None) -> None:
        self.log = log

    def current_stream_wait(self) -> None:
        if self.log is not None:
            self.log.append("wait")


class StandInConfig:
    """DeepEP's ``Config``: only the buffer size hints the adapter reads (gloo needs no buffer)."""

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


def _config(num_ranks: int) -> StandInConfig:
    assert num_ranks == 1 or num_ranks in DEEPEP_CONFIG_RANKS, f"Unsupported number of EP ranks: {num_ranks}"
    return StandInConfig()


class GlooDeepEPBufferStandIn:
    """Stand-in for ``deep_ep.Buffer`` (normal mode) over a gloo group; see the module docstring."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        **unused: Any,
    ) -> None:
        if low_latency_mode:
            raise NotImplementedError("the stand-in has no low-latency mode")
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.calls: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []  # every dispatch and combine, and the waits of async ones, in order

    get_dispatch_config = staticmethod(_config)
    get_combine_config = staticmethod(_config)

    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, StandInEvent]:
        ranks = self.group_size
        assert topk_idx.dim() == 2 and num_experts % ranks == 0
        chosen = topk_idx >= 0
        owner = torch.where(chosen, torch.div(topk_idx, num_experts // ranks, rounding_mode="floor"), -1)
        is_token_in_rank = torch.stack([(owner == r).any(dim=-1) for r in range(ranks)], dim=1)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[chosen], minlength=num_experts).to(torch.int32)
        per_rdma_rank = None
        if ranks > _NVL_PEERS:
            per_node = is_token_in_rank.view(-1, ranks // _NVL_PEERS, _NVL_PEERS).any(dim=-1)
            per_rdma_rank = per_node.sum(dim=0).to(torch.int32)
        return num_tokens_per_rank, per_rdma_rank, num_tokens_per_expert, is_token_in_rank, StandInEvent()

    def _exchange(self, rows: torch.Tensor, *, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
        dist.all_to_all_single(
            out, rows.contiguous(), output_split_sizes=recv_counts, input_split_sizes=send_counts, group=self.group
        )
        return out

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: tuple | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        if isinstance(x, tuple):
            raise NotImplementedError("the stand-in has no fp8 dispatch")
        if num_worst_tokens:
            raise NotImplementedError("the stand-in has no num_worst_tokens")
        self.calls["dispatch" if handle is None else "dispatch(handle)"] += 1
        if handle is not None:
            assert topk_idx is None and topk_weights is None, "a cached dispatch takes no top-k (DeepEP asserts too)"
            self.log.append("dispatch(handle, async_finish)" if async_finish else "dispatch(handle)")
            _in_rank, send_index, send_counts, recv_counts = handle
            rows = x.index_select(0, send_index)
            recv_x = self._exchange(rows, send_counts=send_counts.tolist(), recv_counts=recv_counts.tolist())
            return recv_x, None, None, None, None, StandInEvent(self.log if async_finish else None)
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        self.log.append("dispatch(async_finish)" if async_finish else "dispatch")
        ranks = self.group_size
        # Send order: destination rank, then token (each token once per destination rank).
        send_index = torch.cat([is_token_in_rank[:, r].nonzero().flatten() for r in range(ranks)])
        send_counts = is_token_in_rank.sum(dim=0).to(torch.int64)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        splits = {"send_counts": send_counts.tolist(), "recv_counts": recv_counts.tolist()}
        recv_x = self._exchange(x.index_select(0, send_index), **splits)
        handle = (is_token_in_rank, send_index, send_counts, recv_counts)
        if topk_idx is None:
            return recv_x, None, None, [], handle, StandInEvent()
        local = num_tokens_per_expert.numel() // ranks
        dest = torch.repeat_interleave(torch.arange(ranks), send_counts)  # destination of each sent row
        sent_idx = topk_idx.index_select(0, send_index)
        first = (dest * local).unsqueeze(-1)
        here = (sent_idx >= first) & (sent_idx < first + local)
        recv_idx = self._exchange(torch.where(here, sent_idx - first, -1), **splits)
        recv_weights = None
        if topk_weights is not None:
            sent_weights = topk_weights.index_select(0, send_index)
            recv_weights = self._exchange(torch.where(here, sent_weights, 0.0), **splits)
        counts = torch.bincount(recv_idx[recv_idx >= 0], minlength=local).tolist()
        per_expert = [-(-count // expert_alignment) * expert_alignment for count in counts]
        return recv_x, recv_idx, recv_weights, per_expert, handle, StandInEvent(self.log if async_finish else None)

    def combine(
        self,
        x: torch.Tensor,
        handle: tuple,
        topk_weights: torch.Tensor | None = None,
        bias: Any = None,
        config: Any = None,
        previous_event: Any = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, StandInEvent]:
        if bias is not None:
            raise NotImplementedError("the stand-in has no combine bias")
        kind = "combine" if topk_weights is None else "combine(topk_weights)"
        self.calls[kind] += 1
        if async_finish:
            kind = "combine(async_finish)" if topk_weights is None else "combine(topk_weights, async_finish)"
        self.log.append(kind)
        in_rank, send_index, send_counts, recv_counts = handle
        splits = {"send_counts": recv_counts.tolist(), "recv_counts": send_counts.tolist()}  # the way back
        back = self._exchange(x, **splits)
        combined = _sum_per_token(back, send_index, send_counts.tolist(), num_tokens=in_rank.shape[0])
        weights = None
        if topk_weights is not None:
            back_weights = self._exchange(topk_weights, **splits)
            weights = _sum_per_token(back_weights, send_index, send_counts.tolist(), num_tokens=in_rank.shape[0])
        event = StandInEvent(self.log if async_finish else None)
        return combined.to(x.dtype), weights if weights is None else weights.to(topk_weights.dtype), event


def _sum_per_token(rows: torch.Tensor, index: torch.Tensor, counts: list[int], *, num_tokens: int) -> torch.Tensor:
    """Rows sent back per source rank (rank order), added onto their tokens in fp32, one rank after the other."""
    total = torch.zeros((num_tokens, *rows.shape[1:]), dtype=torch.float32)
    start = 0
    for count in counts:
        total.index_add_(0, index[start : start + count], rows[start : start + count].to(torch.float32))
        start += count
    return total
