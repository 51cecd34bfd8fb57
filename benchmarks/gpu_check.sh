#!/usr/bin/env bash
# The GPU check: under 8 minutes on one GPU. Not used by tests or CI (no GPU there).
#   bash benchmarks/gpu_check.sh            # from the repository root, with .venv built (make install)
# or, on an image whose python3 already holds a CUDA torch (no network), after carrying omegaconf's wheels:
#   python3 -m pip download --no-deps -d .whl omegaconf==2.3.0 datasets dill multiprocess (py312 wheels for a
#     Python 3.12 image) && python3 -m pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
#   then, there: bash benchmarks/gpu_check.sh (logs: GPU_CHECK_DIR; datasets reads the tiny Nemotron corpus)
# Part 1 (steps 1, 3-5) runs concurrently on the GPU: correctness only. Part 2 (steps 2, 6) measures one at a time.
# 1. tiny recipes on NCCL with inductor (1 rank each: one GPU), bf16 parameters, selective AC where the recipe sets it,
#    each with its auto attention (FlexAttention on CUDA) and again with SDPA;
# 2. the flagship layer benchmark with --device cuda (real per-rank shapes, memory caps only), --quick first;
# 3. the CUDA-only kernels that are installed (Transformer Engine, DeepEP) are named, and absent ones said so;
# 4. the packed-attention kernels on CUDA: FlexAttention (compiled, fwd + bwd) and the tiled op against SDPA;
# 5. the mixer kernels (fla, mamba-ssm) against the torch ops (tests/unit/models/kernels/test_mixer_kernels_cuda.py; skips say why),
#    AdamW with its states in pinned host memory against fused AdamW on the device (bitwise), the bf16 AdamW update
#    as one Triton kernel against the eager CPU update (one graph, the same rounding noise), and activation offload
#    (pinned copies, the blocks-in-flight bound, the prefetch in backward) against no offload (bitwise);
#    and, where installed, the tiny Qwen3.6 / Nemotron recipes trained on them (steps 1 keep the torch ops);
# 6. nemo-ac plan against a measured step on this GPU: a mid-size MoE (2.6B parameters, 4k rows, bf16) measured by
#    nemo_ac.simulate.measure (tracked peak, torch.cuda.max_memory_allocated, 3 timed steps, one more under torch's
#    profiler: its top kernels by device time, what dominates where the estimate misses), then its dry run
#    --against it: the memory prediction and the step-time estimate checked on a real GPU; the same with
#    train.optimizer_offload=full (FSDP2's CPUOffloadPolicy, pinned host shards, nccl + gloo): the device peak
#    without the host shards, the host bytes and the host-side time checked where host and device differ.
# Every step runs under its own timeout and the script goes on after a failure; its exit status counts failures.
set -uo pipefail
cd "$(dirname "$0")/.."
# Where no .venv was built (a bare GPU image that holds torch but not this project's other needs), the image's python3
# runs the checkout from PYTHONPATH, with omegaconf / antlr4 installed from wheels carried in .whl/ (README: GPU check).
if [[ -x .venv/bin/python ]]; then
  PY=${PY:-.venv/bin/python}
  TORCHRUN=${TORCHRUN:-.venv/bin/torchrun}
else
  PY=${PY:-python3}
  TORCHRUN=${TORCHRUN:-$(command -v torchrun || echo "$(dirname "$(command -v "$PY")")/torchrun")}
  if [[ -d .whl ]] && ! "$PY" -c "import omegaconf" 2>/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/nemo_ac_site .whl/*.whl
    export PYTHONPATH="/tmp/nemo_ac_site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d -t nemo_ac_gpu_inductor.XXXXXX)}"
LOGS=${GPU_CHECK_DIR:-runs/gpu_check}  # not $OUT: a device runner may own that name
mkdir -p "$LOGS"
failures=0
started_all=$SECONDS

report() {  # report NAME STARTED RC: one verdict line, the log's summary lines and its tail
  local name=$1 started=$2 rc=$3
  if [[ $rc -eq 0 ]]; then
    echo "ok $name in $((SECONDS - started)) s"
  else
    echo "FAILED $name (exit $rc) in $((SECONDS - started)) s; tail:"
    failures=$((failures + 1))
    # torchrun keeps the child's traceback in an error file the log only names: its last frames, into the log
    local error_file
    error_file=$(grep -oE "/[^ ]*torchelastic[^ ]*/error\.json" "$LOGS/$name.log" | head -1)
    if [[ -n $error_file && -f $error_file ]]; then
      "$PY" -c "import json, sys; m = json.load(open(sys.argv[1]))['message']; print(m['extraInfo']['py_callstack'][-3000:] if isinstance(m, dict) else m)" \
        "$error_file" >>"$LOGS/$name.log" 2>&1
    fi
  fi
  grep -E "^(nemo_ac|kernels|compile|summary|against|host) \|" "$LOGS/$name.log" | tail -4
  tail -n 3 "$LOGS/$name.log"
}

step() {  # step NAME TIMEOUT_S COMMAND...: one timed step, alone on the GPU
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s)"
  local started=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  report "$name" "$started" $?
}

declare -A BG_PID BG_START
BG_NAMES=()
step_bg() {  # step_bg NAME TIMEOUT_S COMMAND...: a correctness step sharing the GPU with others (its time is no timing)
  local name=$1 limit=$2
  shift 2
  echo "=== $name (limit ${limit}s, concurrent)"
  BG_START[$name]=$SECONDS
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1 &
  BG_PID[$name]=$!
  BG_NAMES+=("$name")
}

wait_bg() {  # the verdicts of every concurrent step, in the order they were started
  local name rc
  for name in "${BG_NAMES[@]}"; do
    wait "${BG_PID[$name]}"
    rc=$?
    report "$name" "${BG_START[$name]}" "$rc"
  done
  BG_PID=()
  BG_START=()
  BG_NAMES=()
}

"$PY" - <<'EOF'
import importlib.util, torch
print("torch", torch.__version__, "| cuda", torch.version.cuda, "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA")
for mod in ("transformer_engine", "deep_ep", "fla", "mamba_ssm", "causal_conv1d"):
    print(f"  {mod}: {'installed' if importlib.util.find_spec(mod) else 'not installed'}")
EOF

GPU=(dist.backend=nccl dist.device=cuda parallel.fsdp.param_dtype=bfloat16 compile.enabled=true train.steps=6
  backend.linear_attention=torch backend.mamba=torch)
KERNELS=("${GPU[@]:0:5}")  # GPU minus the torch mixer ops
installed() { "$PY" -c "import importlib.util, sys; sys.exit(not all(importlib.util.find_spec(m) for m in sys.argv[1:]))" "$@"; }

# Part 1, correctness, concurrently on the one GPU (each step's time is not a timing): the tiny recipes on NCCL with
# inductor, the packed-attention kernels, the mixer kernels, the host optimizer states.
step_bg tiny_qwen3_moe 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train recipes/tiny/qwen3_moe_tiny.yaml \
  "${GPU[@]}" logging.run_dir="$LOGS/qwen3_moe" logging.progress_bar=never
step_bg tiny_qwen3_6_medpix 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
  recipes/tiny/qwen3_6_medpix_tiny.yaml "${GPU[@]}" parallel.ep=1 parallel.cp=1 logging.run_dir="$LOGS/qwen3_6" \
  logging.progress_bar=never
step_bg tiny_nemotron 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
  recipes/tiny/nemotron_super_v3_tiny.yaml "${GPU[@]}" parallel.ep=1 logging.run_dir="$LOGS/nemotron" \
  logging.progress_bar=never
# The same three with SDPA instead of the auto-chosen FlexAttention: on one H200 with torch 2.11 compiled flex failed
# in all three (benchmarks/results/gpu_check_h200.md) while SDPA trained; these rows keep the rest of the stack checked.
# (name, recipe, the one-GPU layout overrides of the steps above)
for row in "qwen3_moe qwen3_moe_tiny" "qwen3_6_medpix qwen3_6_medpix_tiny parallel.ep=1 parallel.cp=1" \
  "nemotron nemotron_super_v3_tiny parallel.ep=1"; do
  read -r name recipe layout <<<"$row"
  step_bg "tiny_${name}_sdpa" 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
    "recipes/tiny/$recipe.yaml" "${GPU[@]}" $layout backend.attention=sdpa logging.run_dir="$LOGS/${name}_sdpa" \
    logging.progress_bar=never
done
step_bg attention_kernels_cuda 200 "$PY" benchmarks/attention_kernels_cuda.py
step_bg mixer_kernels_cuda 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/models/kernels/test_mixer_kernels_cuda.py
step_bg router_bf16x3_cuda 120 "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/models/kernels/test_bf16x3_linear.py \
  -k cuda
step_bg offload_cuda 200 "$PY" -m pytest -q -rs -p no:cacheprovider tests/unit/distributed/test_offload.py -k cuda
step_bg host_optimizer_states_cuda 200 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/unit/trainer/test_host_optimizer_states.py -k cuda
step_bg adamw_low_precision_fused_cuda 200 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/unit/trainer/test_adamw_bf16_update.py tests/unit/trainer/test_adamw_fp8_states.py -k cuda
if installed fla; then  # fla's Triton dots want head dims >= 16
  step_bg tiny_qwen3_6_fla 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
    recipes/tiny/qwen3_6_medpix_tiny.yaml "${KERNELS[@]}" backend.linear_attention=fla parallel.ep=1 parallel.cp=1 \
    model.linear_attention.key_head_dim=16 model.linear_attention.value_head_dim=16 \
    logging.run_dir="$LOGS/qwen3_6_fla" logging.progress_bar=never
else echo "=== tiny_qwen3_6_fla: skipped, fla not installed (pip install 'nemo_ac[fla]')"; fi
if installed mamba_ssm causal_conv1d; then
  step_bg tiny_nemotron_mamba_ssm 200 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.train \
    recipes/tiny/nemotron_super_v3_tiny.yaml "${KERNELS[@]}" backend.mamba=mamba_ssm parallel.ep=1 \
    logging.run_dir="$LOGS/nemotron_mamba_ssm" logging.progress_bar=never
else echo "=== tiny_nemotron_mamba_ssm: skipped, mamba-ssm / causal-conv1d not installed"; fi
wait_bg

# Part 2, timings, one measurement on the GPU at a time (a dry run, CPU only, may run beside one): nemo-ac plan
# against a measured mid-size MoE step, then with the full optimizer offload, then the flagship layer benchmark.
# The estimate for the GPU this is (the --against line prints the estimate's error only for that GPU; another GPU than
# the specs describe gets the H100 estimate and no error).
PLAN_GPU=$("$PY" -c "import torch; from nemo_ac.simulate.gpus import spec_for_device_name as spec_of
spec = spec_of(torch.cuda.get_device_name()); print(spec.name if spec else 'h100-80gb')")
echo "=== plan estimates for: $PLAN_GPU"
MID=(dist.backend=nccl dist.device=cuda parallel.fsdp.param_dtype=bfloat16 model.moe.force_balanced_routing=true
  model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 model.num_key_value_heads=4 model.head_dim=128
  model.vocab_size=32000 model.moe.num_experts=64 model.moe.num_experts_per_tok=8 model.moe.moe_intermediate_size=768
  data.seq_len=4096 data.max_doc_tokens=400 train.micro_batch_size=1 train.global_batch_size=2)
step measure_mid_moe 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.simulate.measure \
  recipes/tiny/qwen3_moe_tiny.yaml --out "$LOGS/measure_mid" --timed-steps 3 --profile "${MID[@]}"
grep -E "^profile \|" "$LOGS/measure_mid_moe.log" | head -16 | cut -c1-170  # what dominates the measured step
step_bg plan_against_measured 200 "$PY" -m nemo_ac.cli plan recipes/tiny/qwen3_moe_tiny.yaml --world-size 1 \
  --gpu "$PLAN_GPU" --against "$LOGS/measure_mid" "${MID[@]}"
step measure_mid_moe_full_offload 150 "$TORCHRUN" --standalone --nproc-per-node 1 -m nemo_ac.simulate.measure \
  recipes/tiny/qwen3_moe_tiny.yaml --out "$LOGS/measure_mid_full" --timed-steps 2 "${MID[@]}" \
  train.optimizer_offload=full
step_bg plan_against_measured_full_offload 200 "$PY" -m nemo_ac.cli plan recipes/tiny/qwen3_moe_tiny.yaml \
  --world-size 1 --gpu "$PLAN_GPU" --against "$LOGS/measure_mid_full" "${MID[@]}" train.optimizer_offload=full
step flagship_layers_quick_cuda 150 "$PY" benchmarks/flagship_layers.py --quick --device cuda
wait_bg
grep -hE "^against|^host" "$LOGS/plan_against_measured.log" "$LOGS/plan_against_measured_full_offload.log"
# The full layer benchmark only while the whole check stays under 8 minutes.
if (( SECONDS - started_all < 300 )); then
  step flagship_layers_cuda $(( 470 - (SECONDS - started_all) )) "$PY" benchmarks/flagship_layers.py --device cuda \
    --dtypes bfloat16
else echo "=== flagship_layers_cuda: skipped, $((SECONDS - started_all)) s spent of the 8-minute check"; fi
echo "gpu_check: $failures failed step(s) in $((SECONDS - started_all)) s; logs in $LOGS"
exit "$failures"
