"""DeepEP's wire model in the dry run: one copy per destination rank over NVLink, one per destination node over RDMA."""

from __future__ import annotations

import pytest

from nemo_ac.simulate.counters import CollectiveRecord
from nemo_ac.simulate.estimate import collective_seconds
from nemo_ac.simulate.gpus import COLLECTIVE_LATENCY_S, GPUS, LINK_EFFICIENCY
from nemo_ac.simulate.routing import DeepEPCopies, deepep_copies


def test_a_token_whose_experts_share_a_rank_is_sent_once() -> None:
    """8 experts on 4 ranks (2 each), top-2 round robin: token t goes to experts 2t, 2t+1, both on rank t mod 4. Of
    rank 0's 4 tokens, 3 leave it: 6 (token, expert) rows, 3 copies to ranks, and 2 to the other node (ranks 2, 3
    with 2 GPUs per node)."""
    copies = deepep_copies(tokens=4, top_k=2, num_experts=8, group_ranks=(0, 1, 2, 3), rank_in_group=0, gpus_per_node=2)
    assert copies == DeepEPCopies(per_rank=3 / 6, per_node=2 / 6)


def test_a_token_spread_over_every_rank_crosses_to_each_other_node_once() -> None:
    """4 experts on 4 ranks, top-4: the token reaches every rank (3 remote rows, 3 rank copies) and the other node
    once (ranks 2 and 3 share it)."""
    copies = deepep_copies(tokens=1, top_k=4, num_experts=4, group_ranks=(0, 1, 2, 3), rank_in_group=0, gpus_per_node=2)
    assert copies == DeepEPCopies(per_rank=1.0, per_node=1 / 3)


def test_within_one_node_nothing_goes_over_rdma() -> None:
    copies = deepep_copies(tokens=64, top_k=8, num_experts=128, group_ranks=tuple(range(8)), rank_in_group=3,
                           gpus_per_node=8)  # fmt: skip
    assert copies.per_node == 0 and copies.per_rank == pytest.approx(1 / 8)


def test_deepep_time_is_the_longer_of_its_nvlink_and_rdma_legs() -> None:
    gpu = GPUS["h100-80gb"]
    record = CollectiveRecord(calls=2, wire_bytes=10**9, network_bytes=2 * 10**8, ranks=tuple(range(16)))
    nvlink = 10**9 / (gpu.nvlink_bytes_per_s * LINK_EFFICIENCY)
    rdma = 2 * 10**8 / (gpu.network_bytes_per_s * LINK_EFFICIENCY)
    assert rdma > nvlink
    assert collective_seconds(record, "deepep", gpu=gpu) == pytest.approx(2 * COLLECTIVE_LATENCY_S + rdma)
