"""What ``backend.dispatcher: deepep`` needs of a recipe (``check_deepep``, one of ``validate.RULES``) and of the
machine (``deepep_environment_issues``, part of ``environment.check_environment`` / ``--check-env``), checked before
any process group starts. The install line lives here too, so every error that names it says the same.

DeepEP's high-throughput kernels (the ``deep_ep.Buffer`` dispatch / combine nemo_ac calls), as DeepEP defines them:

- ranks: intranode (NVLink) kernels are compiled for 2, 4 or 8 ranks in one node; internode kernels (RDMA through
  NVSHMEM) for 8 GPUs per node times 2, 4, 8, 16, 18 or 20 nodes, and in DeepEP 2.x also 3, 6 or 12 nodes
  (``SWITCH_RANKS`` / ``SWITCH_RDMA_RANKS`` in csrc/kernels/launch.cuh at v1.2.1, csrc/kernels/legacy/launch.cuh at
  2.1.0; any other size fails an assert at the first dispatch, ``Buffer.get_dispatch_config`` has no config for it).
  The rule accepts what either release runs; the message says which sizes need 2.x;
- dtypes: combine's kernel is compiled for bfloat16 tokens only (``SWITCH_TYPES``), and the backward of dispatch is a
  combine, so the tokens (the compute dtype, ``parallel.fsdp.param_dtype``) must be bfloat16; router weights travel
  as float32 (the adapter casts them). Dispatch could also take fp8, which nemo_ac does not use;
- CUDA devices, and DeepEP built on them against NVSHMEM (internode; optional for intranode in DeepEP v1).
"""

from __future__ import annotations

import importlib.util

from nemo_ac.config.errors import ConfigIssue
from nemo_ac.config.schema import RecipeConfig

INTRANODE_EP_SIZES = (2, 4, 8)
GPUS_PER_NODE = 8  # DeepEP's internode kernels assume 8 NVLink peers per node
INTERNODE_EP_SIZES = tuple(GPUS_PER_NODE * nodes for nodes in (2, 4, 8, 16, 18, 20))
INTERNODE_EP_SIZES_V2 = tuple(GPUS_PER_NODE * nodes for nodes in (3, 6, 12))  # DeepEP 2.x only
SUPPORTED_EP_SIZES = INTRANODE_EP_SIZES + INTERNODE_EP_SIZES + INTERNODE_EP_SIZES_V2

DEEPEP_INSTALL = (
    "DeepEP is built from source against NVSHMEM, it is no pip extra of nemo_ac (the PyPI 'deep-ep' package fails to "
    "build: 'Failed to find NVSHMEM'). On a CUDA machine: pip install nvidia-nvshmem-cu12; git clone "
    "https://github.com/deepseek-ai/DeepEP; cd DeepEP; git checkout v1.2.1; python setup.py install "
    "(NVSHMEM_DIR=<its root> for an NVSHMEM not installed by pip; README.md: 'The DeepEP backend')"
)


def _unsupported_ep_size(ep: int) -> str:
    def listed(sizes: tuple[int, ...]) -> str:
        return ", ".join(map(str, sizes))

    return (
        f"{ep} is not an expert-parallel size DeepEP's kernels support: {listed(INTRANODE_EP_SIZES)} ranks within one "
        f"NVLink node, or {listed(INTERNODE_EP_SIZES)} across nodes of {GPUS_PER_NODE} GPUs (RDMA, DeepEP built with "
        f"NVSHMEM; also {listed(INTERNODE_EP_SIZES_V2)} with DeepEP 2.x); set parallel.ep to one of those, or "
        "backend.dispatcher: torch"
    )


def dispatcher_ep_issue(dispatcher: str, *, ep: int) -> ConfigIssue | None:
    """A dispatcher other than ``torch`` moves tokens between expert-parallel ranks: it needs ``parallel.ep > 1``.
    The one statement of the rule: validation (``check_deepep``) and the plan (``decide_plan``, for callers that
    skip validation) both ask it, and ``apply_ep`` acts on the plan's ``ep`` without asking again."""
    if dispatcher == "torch" or ep > 1:
        return None
    return ConfigIssue(
        "backend.dispatcher",
        f"{dispatcher} moves tokens between expert-parallel ranks but parallel.ep is 1; set parallel.ep > 1 or "
        "backend.dispatcher: torch",
    )


def check_deepep(recipe: RecipeConfig, world_size: int) -> list[ConfigIssue]:
    """The recipe itself: expert parallel over a size DeepEP supports, on CUDA, with bfloat16 tokens."""
    if recipe.backend.dispatcher != "deepep":
        return []
    par = recipe.parallel
    issues = []
    without_ep = dispatcher_ep_issue(recipe.backend.dispatcher, ep=par.ep)
    if without_ep is not None:
        issues.append(without_ep)
    elif par.ep not in SUPPORTED_EP_SIZES:
        issues.append(ConfigIssue("parallel.ep", _unsupported_ep_size(par.ep)))
    if recipe.dist.device == "cpu":
        issues.append(ConfigIssue("backend.dispatcher", "deepep runs on CUDA only; use dispatcher: torch on CPU"))
    if par.fsdp.param_dtype != "bfloat16":
        issues.append(
            ConfigIssue(
                "parallel.fsdp.param_dtype",
                f"{par.fsdp.param_dtype} with backend.dispatcher: deepep: the tokens DeepEP moves are in the compute "
                "dtype, and its combine kernel (also the backward of dispatch) takes bfloat16 only; set "
                "parallel.fsdp.param_dtype: bfloat16, or backend.dispatcher: torch",
            )
        )
    return issues


def deepep_environment_issues(recipe: RecipeConfig, *, cuda_available: bool | None) -> list[ConfigIssue]:
    """This machine: ``deep_ep`` importable and a GPU visible (``cuda_available`` None: not asked)."""
    if recipe.backend.dispatcher != "deepep":
        return []
    issues = []
    if importlib.util.find_spec("deep_ep") is None:
        spans_nodes = (
            f" (parallel.ep={recipe.parallel.ep} spans nodes: DeepEP's internode kernels need it built with NVSHMEM)"
            if recipe.parallel.ep > GPUS_PER_NODE
            else ""
        )
        issues.append(
            ConfigIssue(
                "backend.dispatcher",
                f"'deepep' needs DeepEP (the 'deep_ep' module), which is not installed{spans_nodes}. {DEEPEP_INSTALL}. "
                "Or set backend.dispatcher: torch",
            )
        )
    if cuda_available is False:
        issues.append(
            ConfigIssue(
                "backend.dispatcher",
                "'deepep' runs DeepEP's CUDA kernels and no GPU is visible here; run on CUDA devices, or set "
                "backend.dispatcher: torch",
            )
        )
    return issues
