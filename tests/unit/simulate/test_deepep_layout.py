"""DeepEP in the dry run: one copy per destination rank over NVLink, one per destination node over RDMA, the tokens a
rank receives counted once each (``simulate.routing.deepep_layout``), and the recipe's own DeepEP dispatcher run on
fake tensors with those sizes."""

from __future__ import annotations

import pytest

from nemo_ac.simulate.counters import CollectiveRecord
from nemo_ac.simulate.estimate import collective_seconds
from nemo_ac.simulate.gpus import COLLECTIVE_LATENCY_S, GPUS, LINK_EFFICIENCY
from nemo_ac.simulate.routing import DeepEPLayout, RoutingAssumption, deepep_layout

BALANCED = RoutingAssumption()


def test_a_token_whose_experts_share_a_rank_is_sent_and_received_once() -> None:
    """8 experts on 4 ranks (2 each), top-2 round robin: token t goes to experts 2t, 2t+1, both on rank t mod 4. Of
    rank 0's 4 tokens, 3 leave it, each to one rank (3 copies, not 6 rows), 2 to the other node (ranks 2, 3 with 2
    GPUs per node). Rank 0 receives one token from each of the 4 sources (itself included) with 2 rows each."""
    layout = deepep_layout(tokens=4, top_k=2, num_experts=8, group_ranks=(0, 1, 2, 3), rank_in_group=0,
                           gpus_per_node=2, assumption=BALANCED)  # fmt: skip
    assert layout == DeepEPLayout(received=4, rows_here=8, remote_ranks_per_token=3 / 4, remote_nodes_per_token=2 / 4)


def test_a_token_spread_over_every_rank_crosses_to_each_other_node_once() -> None:
    """4 experts on 4 ranks, top-4: the token reaches every rank (3 remote rows, 3 rank copies) and the other node
    once (ranks 2 and 3 share it)."""
    layout = deepep_layout(tokens=1, top_k=4, num_experts=4, group_ranks=(0, 1, 2, 3), rank_in_group=0,
                           gpus_per_node=2, assumption=BALANCED)  # fmt: skip
    assert (layout.remote_ranks_per_token, layout.remote_nodes_per_token) == (3, 1)
    assert (layout.received, layout.rows_here) == (4, 4)


def test_within_one_node_nothing_goes_over_rdma() -> None:
    layout = deepep_layout(tokens=64, top_k=8, num_experts=128, group_ranks=tuple(range(8)), rank_in_group=3,
                           gpus_per_node=8, assumption=BALANCED)  # fmt: skip
    assert layout.remote_nodes_per_token == 0 and layout.remote_ranks_per_token == pytest.approx(7 / 8)


def test_a_busier_expert_here_receives_at_least_its_rows() -> None:
    """Imbalance 4 on 16 experts, top-2 over 64 tokens: the hot expert 0 (on rank 0) takes 4x the mean of 8 rows from
    each source, so rank 0 receives at least 32 tokens from each, more than the round robin's 16."""
    hot = deepep_layout(tokens=64, top_k=2, num_experts=16, group_ranks=(0, 1, 2, 3), rank_in_group=0,
                        gpus_per_node=8, assumption=RoutingAssumption(imbalance=4.0))  # fmt: skip
    assert hot.received == 4 * 32 and hot.rows_here == 4 * (32 + 3 * 7)  # the other 96 rows: 7 or 6 per expert


def test_deepep_time_is_the_longer_of_its_nvlink_and_rdma_legs() -> None:
    gpu = GPUS["h100-80gb"]
    record = CollectiveRecord(calls=2, wire_bytes=10**9, network_bytes=2 * 10**8, ranks=tuple(range(16)))
    nvlink = 10**9 / (gpu.nvlink_bytes_per_s * LINK_EFFICIENCY)
    rdma = 2 * 10**8 / (gpu.network_bytes_per_s * LINK_EFFICIENCY)
    assert rdma > nvlink
    assert collective_seconds(record, "deepep", gpu=gpu) == pytest.approx(2 * COLLECTIVE_LATENCY_S + rdma)


def _nemotron_counts(dispatcher: str):
    from nemo_ac.config import load_recipe, validate_recipe
    from nemo_ac.simulate.run import SimulationOptions, simulate
    from tests.factories import FLAGSHIPS_AT_WORLD_SIZE

    path, world = FLAGSHIPS_AT_WORLD_SIZE["nemotron"]
    overrides = ["data.seq_len=4096", "train.global_batch_size=512", "train.micro_batch_size=2", "model.num_layers=3",
                 "model.layer_pattern=M*E", "compile.enabled=false", f"backend.dispatcher={dispatcher}",
                 "activation_checkpointing.selective.save_communication=false"]  # fmt: skip
    recipe = load_recipe(str(path), overrides)
    simulation = simulate(recipe, validate_recipe(recipe, world_size=world), SimulationOptions(world_size=world))
    return recipe, simulation


def test_the_dry_run_runs_the_recipes_deepep_dispatcher_with_the_assumed_sizes() -> None:
    """Nemotron Super's shape (EP64 over 8 nodes, 8,192 tokens per rank, one MoE block): DeepEP's four ops are the
    collectives (no all-to-all stands in), each call's RDMA share is the layout's, and the permutation runs once, on
    the expert side: the forward's index_select traffic is under a third of the all-to-all dispatcher's, which
    permutes on both sides and back."""
    recipe, deepep = _nemotron_counts("deepep")
    _, torch_dispatch = _nemotron_counts("torch")
    counts = deepep.measurement.counts
    kinds = {kind for _, kind, _ in counts.collectives}
    assert "deepep" in kinds and "all_to_all" not in kinds
    calls = [call for call in counts.calls if call.kind == "deepep" and call.weight == 1]  # the micro batch run
    # dispatch + combine in forward, again in the recompute (selective MoE, save_communication false),
    # their backwards (a combine, a dispatch) in backward
    assert [call.phase for call in calls] == ["forward"] * 2 + ["recompute"] * 2 + ["backward"] * 2
    layout = deepep_layout(tokens=2 * 4096, top_k=recipe.model.moe.num_experts_per_tok,
                           num_experts=recipe.model.moe.num_experts, group_ranks=tuple(range(64)), rank_in_group=0,
                           gpus_per_node=8, assumption=BALANCED)  # fmt: skip
    for call in calls:
        ratio = layout.remote_nodes_per_token / layout.remote_ranks_per_token
        assert call.network_bytes == pytest.approx(call.wire_bytes * ratio, rel=1e-6)

    def forward_index_select_bytes(simulation) -> int:
        costs = simulation.measurement.counts.costs
        return sum(c.bytes for c in costs if c.name == "index_select" and c.phase == "forward")

    assert 0 < forward_index_select_bytes(deepep) < forward_index_select_bytes(torch_dispatch) / 3
