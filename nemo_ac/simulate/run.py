"""A full-size dry run: one rank of a recipe's real layout, in one CPU process, weights never materialized.

recipe -> validate at the world size -> the plan for the recipe's device (what ``nemo-ac train`` on the cluster
would print) -> a fake process group at the world size -> meshes -> the model on meta, parallelized by the same
``parallelize`` (EP, CP, AC, FSDP2 units) -> parameters as fake tensors -> ``steps`` training steps of the trainer's
own code under FakeTensorMode, counted by ``StepCounter`` and torch's ``FSDPMemTracker``.

What cannot run here is replaced, and every replacement is listed in the report (``Simulation.stand_ins``): the
device is the CPU (fake tensors have no GPU memory either way; FSDP2's CUDA streams need a GPU), so kernels that
need CUDA run as their CPU counterparts of the same work, through one declared table applied to the plan
(``simulate.stand_ins``: FlexAttention -> the tiled op, both visible pairs only; Transformer Engine -> torch modules;
DeepEP -> the all-to-all dispatcher under the same routing assumption; fla / mamba-ssm run their custom ops' fake
implementations); torch.compile is not applied (the eager op stream is counted). Data-dependent
sizes come from stated assumptions (``RoutingAssumption``, ``DataAssumption``).
"""

from __future__ import annotations

import logging
import resource
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from nemo_ac.config.errors import ConfigError, ConfigIssue
from nemo_ac.config.layout import ParallelLayout
from nemo_ac.config.schema import RecipeConfig
from nemo_ac.data.batch import PackedBatch
from nemo_ac.data.sources import recipe_batches
from nemo_ac.distributed.mesh import ParallelMeshes
from nemo_ac.distributed.offload import ActivationOffloader
from nemo_ac.distributed.plan import ParallelPlan
from nemo_ac.distributed.plan.kernels import recipe_kernels
from nemo_ac.simulate.counters import WORLD, StepCounter
from nemo_ac.simulate.fusion import CompiledRegions
from nemo_ac.simulate.gpus import DEEPEP_SMS
from nemo_ac.simulate.host_shards import add_host_shard_costs, fsdp_unit_shards, staging_bytes
from nemo_ac.simulate.host_shards import describe as describe_host_shards
from nemo_ac.simulate.inputs import DataAssumption, reads_offline, standin_micro_batches
from nemo_ac.simulate.memory import HOST_CATEGORIES, HandAdded, PeakSampler, host_bytes
from nemo_ac.simulate.routing import DeepEPRouting, NoDeepEPKernels, RoutingAssumption, install_assumed_routing
from nemo_ac.simulate.stand_ins import (
    DEEPEP_BUFFER_BYTES,
    DEEPEP_STAND_IN,
    executed_kernels,
    execution_recipe,
    planned_gpu_kernel_notes,
)
from nemo_ac.simulate.step import StepMeasurement, measure_step, start_like_a_later_step
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.build import DryRunTarget, build_trainer, build_training, plan_recipe, quiet_logger
from nemo_ac.trainer.loop import count_tokens
from nemo_ac.trainer.optim import adamw_implementation
from nemo_ac.workarounds.fake_world import (
    RealWhereAllReal,
    dtensor_propagation_marked,
    fake_process_group,
    fake_tensor_mode,
)


class SimulationError(RuntimeError):
    """The dry run could not run the step; the message names the op or module and the reason in one line."""


def quiet_known_warnings() -> None:
    """DTensor warns once per HSDP gradient-norm reduction that it runs two all-reduces: true of the real run too,
    counted in the plan's collectives, and not a dry run's output (``nemo-ac plan`` and its search's workers)."""
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


@dataclass(frozen=True)
class SimulationOptions:
    world_size: int
    routing: RoutingAssumption = field(default_factory=RoutingAssumption)
    data: DataAssumption = field(default_factory=DataAssumption)
    micro_batch_limit: int | None = 1  # run at most this many micro batches of the step (None: all)
    rank: int = 0
    memory_timeline: bool = False  # keep device memory by term over the step (nemo-ac plan --memory-plot)


@dataclass
class Simulation:
    recipe: RecipeConfig
    layout: ParallelLayout
    plan: ParallelPlan  # the plan for the recipe's own device
    device_type: str  # the recipe's device ("cuda" for the flagships)
    measurement: StepMeasurement
    stand_ins: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    # What the run keeps in host memory per rank, by term (offloaded optimizer states, offloaded activations of one
    # micro batch; ``memory.host_bytes``). On a CPU plan the host is the device: counted in the peak as well.
    host_bytes: dict[str, int] = field(default_factory=dict)
    tokens_per_step: int = 0  # global tokens of one step
    wall_s: float = 0.0
    peak_rss_bytes: int = 0


def describe_offload(offloader: ActivationOffloader) -> str:
    """The activation offload's bound and what the dry run saw of it (``distributed.offload``)."""
    stats = offloader.stats
    brought_back = stats.prefetched + stats.fetched_on_demand
    return (
        f"activation offload: at most {offloader.in_flight} block{'s' if offloader.in_flight > 1 else ''} of "
        "offloaded tensors on the device "
        f"(activation_checkpointing.offload_in_flight; each held until its window closes, as if its copy took that "
        f"long: held {stats.most_blocks_held} at most); {stats.prefetched} of the {brought_back} copies back the dry run "
        "made prefetched on the side stream while a later block's backward ran, the rest on the compute stream"
    )


def target_device_type(recipe: RecipeConfig) -> str:
    """The device the plan is for: cpu only when the recipe says so (``dist.device: cpu``, or ``auto`` with gloo,
    which resolves to cpu); a GPU otherwise, whatever this machine has."""
    if recipe.dist.device == "cpu" or (recipe.dist.device == "auto" and recipe.dist.backend == "gloo"):
        return "cpu"
    return "cuda"


def mesh_group_labels(meshes: ParallelMeshes) -> dict[str, str]:
    """Process group name -> the mesh dimension(s) it is (dimensions over the same ranks share a group: joined)."""
    named: dict[str, list[str]] = {}

    def add(group: torch.distributed.ProcessGroup, label: str) -> None:
        labels = named.setdefault(group.group_name, [])
        if label not in labels:
            labels.append(label)

    world = meshes.world
    for dim in world.mesh_dim_names or ():
        add(world.get_group(dim), dim)
    add(meshes.dp.get_group(), "dp")
    if meshes.cp is not None:
        add(meshes.cp.get_group(), "cp")
    if meshes.experts is not None:
        for dim in ("ep_shard", "ep"):
            add(meshes.experts.get_group(dim), dim)
    add(torch.distributed.group.WORLD, WORLD)
    return {name: "/".join(labels) for name, labels in named.items()}


def _materialize_fake(model: nn.Module, mode: object) -> None:
    """Parameters and buffers as fake tensors on the CPU (the layout ``to_empty`` gives; no values)."""
    with mode:  # type: ignore[attr-defined]
        model.to_empty(device="cpu")
    tie = getattr(model, "tie_weights", None)
    if tie is not None and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        tie()


def _micro_batches(
    recipe: RecipeConfig, meshes: ParallelMeshes, options: SimulationOptions
) -> tuple[list[PackedBatch], str | None]:
    """This rank's micro batches of the first step (real tensors), and the data assumption when stand-ins were
    used (micro batches past the limit repeat the last one built: they are counted, not run)."""
    if reads_offline(recipe):
        source = recipe_batches(recipe, dp_rank=meshes.dp_rank, dp_size=meshes.dp_size)
        return list(source.batches_for_step(0)), None  # type: ignore[attr-defined]
    per_step = recipe.train.global_batch_size // (recipe.train.micro_batch_size * meshes.dp_size)
    built = min(per_step, options.micro_batch_limit or per_step)
    batches = standin_micro_batches(recipe, assumption=options.data, count=built)
    return batches + batches[-1:] * (per_step - built), options.data.describe(recipe)


def target_plan(recipe: RecipeConfig, layout: ParallelLayout) -> tuple[ParallelPlan, str, list[str]]:
    """The plan the recipe gets on its own device, ``auto`` GPU kernels resolved as on a node that has them
    (``recipe_kernels(..., assume_installed=True)``): the plan, the device type and the kernel assumption said. What
    the report prints, full depth or scaled."""
    device_type = target_device_type(recipe)
    kernels = recipe_kernels(recipe, device_type=device_type, assume_installed=device_type == "cuda")
    plan = plan_recipe(recipe, layout, device_type=device_type, kernels=kernels)
    return plan, device_type, planned_gpu_kernel_notes(recipe, kernels)


def simulate(recipe: RecipeConfig, layout: ParallelLayout, options: SimulationOptions) -> Simulation:
    """The dry run of ``recipe`` at ``layout`` (module docstring). Raises ``SimulationError`` naming what failed."""
    started = time.perf_counter()
    plan, device_type, kernel_notes = target_plan(recipe, layout)
    # What executes here: the plan's kernels through the stand-in table, the recipe on the CPU without compile.
    kernels, kernel_stand_ins = executed_kernels(plan.kernels)
    sim_recipe, execution_notes = execution_recipe(recipe, device_type=device_type)
    stand_ins = kernel_stand_ins + execution_notes
    # Expert parallel and DeepEP as the plan decided them (the plan refuses DeepEP without expert parallel).
    expert_parallel, uses_deepep = plan.ep > 1, plan.kernels.dispatcher.value == "deepep"
    if uses_deepep:
        stand_ins.append(DEEPEP_STAND_IN)
    # DeepEP between compiled graphs dispatches asynchronously: the stand-in orders the MoE as it, the counter times it.
    async_dispatch = uses_deepep and plan.dispatcher_between_graphs()
    if expert_parallel:
        options.routing.check(num_experts=recipe.model.moe.num_experts, top_k=recipe.model.moe.num_experts_per_tok)
    assumptions = ([options.routing.describe()] if expert_parallel else []) + kernel_notes
    if not 0 <= options.rank < layout.world_size:
        raise ConfigError(ConfigIssue("--rank", f"{options.rank} is outside the world of {layout.world_size} ranks"))
    with fake_process_group(rank=options.rank, world_size=layout.world_size):
        fake = fake_tensor_mode()

        def install_routing(model: nn.Module, meshes: ParallelMeshes) -> None:
            if expert_parallel:
                install_assumed_routing(
                    model,
                    assumption=options.routing,
                    ep_rank=meshes.ep_mesh.get_local_rank(),
                    async_dispatch=async_dispatch,
                )

        def materialize(model: nn.Module) -> str:
            _materialize_fake(model, fake)
            return "fake"

        # The run's own build sequence (trainer.build.build_training), as the dry run's twin: fake weights, the
        # AdamW kernel of the planned device (fused on CUDA: no temporary fp32 copy at the step), offloaded
        # optimizer states and activations out of the device's accounting on a GPU plan (host memory is reported
        # apart; on a CPU plan the host is the device).
        setup = build_training(
            sim_recipe,
            layout,
            device=torch.device("cpu"),
            dry_run=DryRunTarget(
                planned_device_type=device_type,
                materialize=materialize,
                prepare_model=install_routing,
                kernels=kernels,
                deepep_buffer_cls=NoDeepEPKernels,
            ),
        )
        model, meshes, optimizer, applied = setup.model, setup.meshes, setup.optimizer, setup.plan
        train = sim_recipe.train
        if train.optimizer is None and (train.optimizer_state_dtype != "float32" or train.master_dtype == "bfloat16"):
            stored = " and ".join(
                f"{dtype} {what}"
                for what, dtype in (("moments", train.optimizer_state_dtype), ("parameters", train.master_dtype))
                if dtype != "float32"
            )
            how = (
                "fused: one compiled kernel per parameter (torch.compile), no temporaries at the step"
                if adamw_implementation(device_type) == "fused"
                else "one parameter at a time, eagerly: fp32 temporaries of one parameter's state at the step"
            )
            codes = " (e4m3 codes, an fp32 scale per 128 elements of a row)" if "float8" in stored else ""
            assumptions.append(f"built-in AdamW with {stored}{codes} (stochastic rounding), {how}")
        elif sim_recipe.train.optimizer is None:
            assumptions.append(
                f"built-in AdamW {adamw_implementation(device_type)}, the kernel it runs on {device_type} "
                "(fused: no foreach temporaries at the step)"
            )
        batches, data_assumption = _micro_batches(sim_recipe, meshes, options)
        if data_assumption:
            assumptions.append(data_assumption)
        trainer = build_trainer(setup, logger=quiet_logger(sim_recipe))
        preparer = make_batch_preparer(cp=layout.cp, cp_rank=meshes.cp_rank, cp_type=sim_recipe.parallel.cp_type)
        prepared = [preparer(batch) for batch in batches]
        # The loss divisor: every dp x cp rank holds as many label tokens (a scalar: no shape depends on it).
        global_tokens = count_tokens(prepared)[0] * layout.dp * layout.cp
        hold_gradients = len(prepared) > 1 and not trainer.options.reduce_grads_on_last_micro_batch_only
        limit = options.micro_batch_limit if hold_gradients else None
        with fake:
            start_like_a_later_step(trainer, hold_gradients=hold_gradients)
        regions = CompiledRegions()
        regions.attach(model, [block.path for block in plan.blocks if block.compile_layout is not None])
        deepep = None
        if uses_deepep:
            deepep = DeepEPRouting(
                top_k=recipe.model.moe.num_experts_per_tok,
                num_experts=recipe.model.moe.num_experts,
                async_dispatch=async_dispatch,
            )
        counter = StepCounter(group_labels=mesh_group_labels(meshes), regions=regions, deepep=deepep)
        # optimizer_offload full on a GPU plan: FSDP's shards, gradients and the states are in host memory.
        shards_on_host = plan.fsdp.parameters_on_host and device_type == "cuda"
        sampler = PeakSampler(
            model,
            optimizer,
            device_type="cpu",
            context=counter.buffer_state,
            host_categories=HOST_CATEGORIES if shards_on_host else frozenset(),
            sequence=(lambda: counter.sequence) if options.memory_timeline else None,
        )
        try:
            with dtensor_propagation_marked(), fake, RealWhereAllReal(), sampler, counter:
                measurement = measure_step(
                    trainer,
                    prepared,
                    global_tokens=global_tokens,
                    counter=counter,
                    sampler=sampler,
                    micro_batch_limit=limit,
                )
        except (RuntimeError, NotImplementedError, TypeError, ValueError, AssertionError) as exc:
            first = " ".join(str(exc).split())[:400]
            raise SimulationError(
                f"the fake step failed after {counter.counts.ops} ops, in {counter.failed_op or counter.last_op}: "
                f"{type(exc).__name__}: "
                f"{first}"
            ) from exc
        finally:
            regions.detach()
    offloader = applied.applied.offloader if applied.applied else None
    host = host_bytes(
        optimizer,
        offloader,
        measurement.micro_batches_run,
        model=model,
        parameters_on_host=plan.fsdp.parameters_on_host,
    )
    if offloader is not None and offloader.stats.packed:
        assumptions.append(describe_offload(offloader))
    if shards_on_host:
        units = fsdp_unit_shards(model)
        reductions = measurement.micro_batches_per_step if hold_gradients or len(prepared) == 1 else 1
        add_host_shard_costs(
            measurement.counts,
            units,
            micro_batches=measurement.micro_batches_per_step,
            reductions=reductions,
            reshard_after_forward=plan.fsdp.reshard_after_forward,
            reduce_dtype=plan.fsdp.reduce_dtype,
        )
        staging = staging_bytes(units)
        for phase, phase_peak in measurement.phase_peaks.items():
            if phase != "optimizer":  # the update runs on the host: nothing staged
                phase_peak.hand_added.append(staging)
        assumptions.append(describe_host_shards(units, reductions=reductions))
    if uses_deepep:
        measurement.peak.hand_added.append(
            HandAdded("DeepEP buffers", DEEPEP_BUFFER_BYTES, "deep_ep.Buffer NVLink + RDMA buffers (assumed size)")
        )
        if async_dispatch:
            assumptions.append(
                "DeepEP's transfers asynchronous (async_finish, between compiled graphs): the forward's dispatch "
                "behind the shared expert's up-projection, its combine behind the down-projection, and their "
                "backwards behind those projections' gradients, each on "
                f"{DEEPEP_SMS} of the GPU's SMs (deep_ep.Buffer.num_sms), the compute on the rest"
            )
    tokens = recipe.train.global_batch_size * (
        recipe.data.max_length if recipe.data.kind == "medpix" else recipe.data.seq_len
    )
    return Simulation(
        recipe=recipe,
        layout=layout,
        plan=plan,
        device_type=device_type,
        measurement=measurement,
        stand_ins=stand_ins,
        assumptions=assumptions,
        tokens_per_step=tokens,
        host_bytes=host,
        wall_s=time.perf_counter() - started,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
