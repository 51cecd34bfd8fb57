"""From a validated recipe to a ready ``Trainer``: the one build sequence the CLI and the test workers share.

Order matters and is the mission's: meshes -> model on meta -> parallelize (EP -> CP -> AC -> compile -> FSDP) ->
materialize weights -> freeze -> optimizer / scheduler -> data. ``train.freeze`` runs before the optimizer (it takes
``requires_grad`` parameters only, so frozen ones get no state) and before the first forward (FSDP2 creates its
unsharded parameters, and with them their ``requires_grad``, lazily there); frozen parameters get no gradient, so
FSDP2 reduces nothing for them.

``build_training`` is the composition root: ``nemo_ac.train``, ``nemo_ac.simulate.measure`` and the dry run
(``nemo_ac.simulate.run``) all build through it, so the dry run counts exactly what a run builds. The dry run differs
only where ``DryRunTarget`` says (fake weights, the planned GPU's optimizer kernel, offloaded memory out of the
device's accounting, no data source); ``tests/unit/trainer/test_composition_root.py`` fails when a build step is
called anywhere else in the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nemo_ac.config import RecipeConfig
from nemo_ac.config.layout import ParallelLayout
from nemo_ac.data.sources import recipe_batches
from nemo_ac.distributed.mesh import ParallelMeshes, build_meshes
from nemo_ac.distributed.parallelize import parallelize
from nemo_ac.distributed.plan import KernelPlan, ParallelPlan, decide_plan, recipe_kernels
from nemo_ac.models import build_model
from nemo_ac.models.freeze import freeze
from nemo_ac.trainer.batching import make_batch_preparer
from nemo_ac.trainer.checkpoint.hf_weights import materialize_weights
from nemo_ac.trainer.expert_balance import expert_bias_callbacks
from nemo_ac.trainer.loop import LoopOptions, Trainer
from nemo_ac.trainer.metrics import MetricsLogger
from nemo_ac.trainer.optim import build_optimizer, build_scheduler


@dataclass
class TrainingSetup:
    """Everything a training run holds besides the loop: what ``build_training`` returns."""

    recipe: RecipeConfig
    layout: ParallelLayout
    meshes: ParallelMeshes
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: Any
    weights: str  # "random init" or where the pretrained weights came from
    frozen: dict[str, int]  # parameter group -> frozen parameter count
    plan: ParallelPlan  # what parallelize did to every block, its kernels, what it produced (offloader, ...)


@dataclass(frozen=True)
class DryRunTarget:
    """How the dry run's build differs from a run's, and nothing else (``build_training(..., dry_run=...)``).

    ``planned_device_type``: the device the plan is for ("cuda" for the flagships, while the dry run computes on
    the CPU). Its AdamW kernel is the one built (fused on CUDA: no foreach temporaries at the step), and on a GPU
    plan what the run moves to host memory (offloaded optimizer states and activations) goes to "meta": it leaves
    the device's accounting, and the report counts host memory apart. On a CPU plan the host is the device.
    ``prepare_model``: called on the parallelized model before its parameters are materialized (the dry run installs
    its routing assumption there). ``materialize``: the parameters and buffers as fake tensors, in place of the
    weights a run initializes or loads; returns what ``TrainingSetup.weights`` says.
    """

    planned_device_type: str
    materialize: Callable[[nn.Module], str]
    prepare_model: Callable[[nn.Module, ParallelMeshes], None] | None = None
    # The kernels the dry run executes: the planned ones with the CPU stand-ins of the CUDA-only kernels
    # (``simulate.stand_ins``); left out, resolved for the CPU as a run there would.
    kernels: KernelPlan | None = None
    # The ``deep_ep.Buffer`` its DeepEP dispatcher gets: one that runs no kernel (under fake tensors DeepEP's ops run
    # their fake impls), so that no DeepEP install is needed.
    deepep_buffer_cls: type | None = None

    @property
    def host(self) -> str:
        """Where offloaded tensors go: "meta" on a GPU plan (out of the device's accounting), else "cpu"."""
        return "meta" if self.planned_device_type == "cuda" else "cpu"


def decide_recipe_plan(
    model: nn.Module,
    recipe: RecipeConfig,
    *,
    kernels: KernelPlan | None,
    ep: int,
    cp: int,
    device_type: str,
    torch_version: str | None = None,
) -> ParallelPlan:
    """The plan for a meta-device ``model`` of ``recipe``: the one place the recipe's sections are handed to
    ``decide_plan`` (the apply steps take the plan alone)."""
    return decide_plan(
        model,
        model_config=recipe.model,
        parallel=recipe.parallel,
        activation_checkpointing=recipe.activation_checkpointing,
        compile=recipe.compile,
        backend=recipe.backend,
        data=recipe.data,
        kernels=kernels,
        ep=ep,
        cp=cp,
        device_type=device_type,
        torch_version=torch_version,
        optimizer_offload=recipe.train.optimizer_offload,
        master_dtype=recipe.train.master_dtype,
    )


def planned_model(
    recipe: RecipeConfig,
    layout: ParallelLayout,
    *,
    device_type: str,
    torch_version: str | None = None,
    kernels: KernelPlan | None = None,
) -> tuple[nn.Module, ParallelPlan]:
    """The model on meta, built with the plan's kernels, and the plan for it: what ``plan_recipe`` prints and
    ``build_parallel_model`` applies, from the same code. ``kernels``: left out, ``recipe_kernels`` for
    ``device_type`` (the one resolution of ``auto``; the recipe itself is never rewritten with the choices)."""
    kernels = kernels if kernels is not None else recipe_kernels(recipe, device_type=device_type)
    model = build_model(recipe.model, experts_impl=kernels.experts.value, router_gemm=kernels.router.value)
    plan = decide_recipe_plan(
        model,
        recipe,
        kernels=kernels,
        ep=layout.ep,
        cp=layout.cp,
        device_type=device_type,
        torch_version=torch_version,
    )
    return model, plan


def plan_recipe(
    recipe: RecipeConfig,
    layout: ParallelLayout,
    *,
    device_type: str,
    torch_version: str | None = None,
    kernels: KernelPlan | None = None,
) -> ParallelPlan:
    """The plan a run of ``recipe`` at ``layout`` on ``device_type`` would apply, from the model on meta (no process
    group, no weights): what ``nemo-ac validate`` checks (``preflight``) and ``--plan`` prints. ``ConfigError``
    for a layout the plan refuses. ``torch_version`` decides the workaround gates as if that torch were running.
    ``kernels``: the ``KernelPlan`` to plan with (left out: resolved for ``device_type``, as a run on this machine
    resolves them)."""
    _, plan = planned_model(recipe, layout, device_type=device_type, torch_version=torch_version, kernels=kernels)
    return plan


def build_parallel_model(
    recipe: RecipeConfig,
    layout: ParallelLayout,
    *,
    device: torch.device,
    kernels: KernelPlan | None = None,
    deepep_buffer_cls: type | None = None,
) -> tuple[nn.Module, ParallelMeshes, ParallelPlan]:
    """Meshes, the model on meta and its plan (``planned_model``), parallelized as the plan says (weights not yet
    materialized). ``kernels``: left out, resolved for ``device``. ``deepep_buffer_cls``: ``parallelize``'s."""
    meshes = build_meshes(layout, device_type=device.type)
    torch.manual_seed(recipe.train.seed)
    model, plan = planned_model(recipe, layout, device_type=meshes.device_type, kernels=kernels)
    plan = parallelize(model, plan=plan, meshes=meshes, deepep_buffer_cls=deepep_buffer_cls)
    return model, meshes, plan


def build_training(
    recipe: RecipeConfig, layout: ParallelLayout, *, device: torch.device, dry_run: DryRunTarget | None = None
) -> TrainingSetup:
    """The parallelized model with its weights, frozen groups, optimizer, scheduler and this rank's data: the one
    build sequence (module docstring). ``dry_run``: build the dry run's twin instead (``DryRunTarget``; no data
    source: the dry run makes its own micro batches)."""
    kernels = dry_run.kernels if dry_run is not None else None
    buffer_cls = dry_run.deepep_buffer_cls if dry_run is not None else None
    model, meshes, plan = build_parallel_model(
        recipe, layout, device=device, kernels=kernels, deepep_buffer_cls=buffer_cls
    )
    if dry_run is None:
        weights = materialize_weights(
            model,
            model_config=recipe.model,
            device=device,
            seed=recipe.train.seed,
            parameter_device=torch.device("cpu") if plan.fsdp.parameters_on_host else None,
        )
    else:
        offloader = plan.applied.offloader if plan.applied is not None else None
        if offloader is not None:
            offloader.accounting_host = dry_run.host
        if dry_run.prepare_model is not None:
            dry_run.prepare_model(model, meshes)
        weights = dry_run.materialize(model)
    switches = dataclasses.asdict(recipe.train.freeze)
    frozen = freeze(model, **switches) if any(switches.values()) else {}
    optimizer = build_optimizer(
        model,
        recipe.train,
        device_type=device.type if dry_run is None else dry_run.planned_device_type,
        extensions=recipe.extensions.allow,
        host="cpu" if dry_run is None else dry_run.host,
    )
    scheduler = build_scheduler(optimizer, recipe.train, extensions=recipe.extensions.allow)
    data = recipe_batches(recipe, dp_rank=meshes.dp_rank, dp_size=meshes.dp_size) if dry_run is None else None
    return TrainingSetup(
        recipe=recipe,
        layout=layout,
        meshes=meshes,
        device=device,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data=data,
        weights=weights,
        frozen=frozen,
        plan=plan,
    )


def quiet_logger(recipe: RecipeConfig) -> MetricsLogger:
    """A logger that records nothing and prints nothing (workers and benchmarks read ``Trainer.fit``'s history)."""
    return MetricsLogger(
        run_dir="unused", total_steps=recipe.train.steps, enabled=False, jsonl=False, progress_bar="never", log_every=1
    )


def build_trainer(
    setup: TrainingSetup,
    *,
    logger: MetricsLogger,
    metric_sources: Mapping[str, Callable[[], Any]] | None = None,
) -> Trainer:
    """The training loop over ``setup``, with the recipe's step options and aux-loss-free bias updates."""
    recipe, layout = setup.recipe, setup.layout
    return Trainer(
        model=setup.model,
        optimizer=setup.optimizer,
        scheduler=setup.scheduler,
        data=setup.data,
        prepare_batch=make_batch_preparer(cp=layout.cp, cp_rank=setup.meshes.cp_rank, cp_type=recipe.parallel.cp_type),
        device=setup.device,
        logger=logger,
        options=LoopOptions(
            steps=recipe.train.steps,
            grad_clip=recipe.train.grad_clip,
            loss_chunk_tokens=recipe.train.loss_chunk_tokens,
            aux_loss_coef=recipe.model.moe.aux_loss_coef,
            backward_on_thread=recipe.train.backward_on_thread,
            fail_after_step=recipe.train.fail_after_step,
            reduce_grads_on_last_micro_batch_only=recipe.parallel.fsdp.reduce_grads == "last_micro_batch",
            metric_sources=dict(metric_sources or {}),
            # Aux-loss-free balancing: router biases follow the step's global expert loads (moe.bias_update_rate).
            post_step_callbacks=expert_bias_callbacks(setup.model, moe=recipe.model.moe),
        ),
        loss_group=setup.meshes.loss_group,
    )
