#!/usr/bin/env bash
# The GPU check: under 8 minutes on one GPU. Not used by tests or CI (no GPU there).
#   bash benchmarks/gpu_check.sh            # from the repository root, with .venv built (make install)
# 1. tiny recipes on NCCL with inductor (1 rank each: one GPU), bf16 parameters, selective AC where the recipe sets it;
# 2. the flagship layer benchmark with --device cuda (real per-rank shapes, memory caps only), --quick first;
# 3. the CUDA-only kernels that are installed (Transformer Engine, DeepEP) are named, and absent ones said so;
# 4. the packed-attention kernels on CUDA: FlexAttention (compiled, fwd + bwd) and the tiled op against SDPA;
# 5. the mixer kernels (fla, mamba-ssm) against the torch ops (tests/unit/models/test_mixer_kernels_cuda.py; skips say why),
#    and AdamW with its states in pinned host memory against fused AdamW on the device (bitwise);
#    and, where installed, the tiny Qwen3.6 / Nemotron recipes trained on them (steps 1 keep the torch ops);
# 6. nemo-ac plan against a measured step on this GPU: a mid-size MoE (1.3B parameters, 4k rows, bf16) measured by
#    nemo_ac.simulate.measure (tracked peak, torch.cuda.max_memory_allocated, 3 timed steps), then its dry run
#    --against it: the memory prediction and the step-time estimate checked on a real GPU; the same with
#    train.optimizer_offload=full (FSDP2's CPUOffloadPolicy, pinned host shards, nccl + gloo): the device peak
#    without the host shards, the host bytes and the host-side time checked where host and device differ.
# Every step runs under its own timeout and the script goes on after a failure; its exit status counts failures.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d -t nemo_ac_gpu_inductor.XXXXXX)}"
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
failures=0

step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  local started=$SECONDS
  if timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; then
    echo "ok $name in $((SECONDS - started)) s"
  else
    echo "FAILED $name (exit $?) in $((SECONDS - started)) s; tail:"
    failures=$((failures + 1))
  fi
  grep -E "^(nemo_ac|kernels|compile|summary) \|" "$OUT/$name.log" | tail -4
  tail -n 3 "$OUT/$name.log"
}

"$PY" - <<'EOF'
import importlib.util, torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
for mod in ("transformer_engine", "deep_ep", "fla", "mamba_ssm", "causal_conv1d"):
    print(f"  {mod}: {'installed' if importlib.util.find_spec(mod) else 'not installed'}")
EOF

GPU=(dist.backend=nccl dist.device=cuda parallel.fsdp.param_dtype=bfloat16 compile.enabled=true train.steps=6
  backend.linear_attention=torch backend.mamba=torch)
step tiny_qwen3_moe 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train recipes/tiny/qwen3_moe_tiny.yaml \
  "${GPU[@]}" logging.run_dir="$OUT/qwen3_moe" logging.progress_bar=never
step tiny_qwen3_6_medpix 180 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
  recipes/tiny/qwen3_6_medpix_tiny.yaml "${GPU[@]}" parallel.ep=1 parallel.cp=1 logging.run_dir="$OUT/qwen3_6" \
  logging.progress_bar=never
step tiny_nemotron 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
  recipes/tiny/nemotron_super_v3_tiny.yaml "${GPU[@]}" parallel.ep=1 logging.run_dir="$OUT/nemotron" \
  logging.progress_bar=never
MID=(dist.backend=nccl dist.device=cuda parallel.fsdp.param_dtype=bfloat16 model.moe.force_balanced_routing=true
  model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 model.num_key_value_heads=4 model.head_dim=128
  model.vocab_size=32000 model.moe.num_experts=64 model.moe.num_experts_per_tok=8 model.moe.moe_intermediate_size=768
  data.seq_len=4096 data.max_doc_tokens=400 train.micro_batch_size=1 train.global_batch_size=2)
step measure_mid_moe 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.simulate.measure \
  recipes/tiny/qwen3_moe_tiny.yaml --out "$OUT/measure_mid" --timed-steps 3 "${MID[@]}"
step plan_against_measured 150 "$PY" -m nemo_ac.cli plan recipes/tiny/qwen3_moe_tiny.yaml --world-size 1 \
  --gpu h200-141gb --against "$OUT/measure_mid" "${MID[@]}"
grep -E "^against" "$OUT/plan_against_measured.log"
step measure_mid_moe_full_offload 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.simulate.measure \
  recipes/tiny/qwen3_moe_tiny.yaml --out "$OUT/measure_mid_full" --timed-steps 2 "${MID[@]}" \
  train.optimizer_offload=full
step plan_against_measured_full_offload 150 "$PY" -m nemo_ac.cli plan recipes/tiny/qwen3_moe_tiny.yaml \
  --world-size 1 --gpu h200-141gb --against "$OUT/measure_mid_full" "${MID[@]}" train.optimizer_offload=full
grep -E "^against|^host" "$OUT/plan_against_measured_full_offload.log"
step attention_kernels_cuda 120 "$PY" benchmarks/attention_kernels_cuda.py
step mixer_kernels_cuda 120 "$PY" -m pytest -q -rs tests/unit/models/test_mixer_kernels_cuda.py
step host_optimizer_states_cuda 90 "$PY" -m pytest -q -rs tests/unit/trainer/test_host_optimizer_states.py -k cuda
installed() { "$PY" -c "import importlib.util, sys; sys.exit(not all(importlib.util.find_spec(m) for m in sys.argv[1:]))" "$@"; }
KERNELS=("${GPU[@]:0:5}")  # GPU minus the torch mixer ops
if installed fla; then  # fla's Triton dots want head dims >= 16
  step tiny_qwen3_6_fla 180 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
    recipes/tiny/qwen3_6_medpix_tiny.yaml "${KERNELS[@]}" backend.linear_attention=fla parallel.ep=1 parallel.cp=1 \
    model.linear_attention.key_head_dim=16 model.linear_attention.value_head_dim=16 \
    logging.run_dir="$OUT/qwen3_6_fla" logging.progress_bar=never
else echo "=== tiny_qwen3_6_fla: skipped, fla not installed (pip install 'nemo_ac[fla]')"; fi
if installed mamba_ssm causal_conv1d; then
  step tiny_nemotron_mamba_ssm 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
    recipes/tiny/nemotron_super_v3_tiny.yaml "${KERNELS[@]}" backend.mamba=mamba_ssm parallel.ep=1 \
    logging.run_dir="$OUT/nemotron_mamba_ssm" logging.progress_bar=never
else echo "=== tiny_nemotron_mamba_ssm: skipped, mamba-ssm / causal-conv1d not installed"; fi
step flagship_layers_quick_cuda 150 "$PY" benchmarks/flagship_layers.py --quick --device cuda
step flagship_layers_cuda 240 "$PY" benchmarks/flagship_layers.py --device cuda --dtypes bfloat16
echo "gpu_check: $failures failed step(s); logs in $OUT"
exit "$failures"
