#!/usr/bin/env bash
# The GPU check: run it after every change to GPU code. On whatever GPUs this machine
# has, it runs the GPU tests, the main job (the parity run of the README), a short
# compiled UniEP-vs-TorchTitan run, a short megakernel run and a benchmark smoke test,
# then prints one PASS/FAIL line per item (the numbers behind it in its log).
#
#   scripts/gpu_check.sh            # about 9 minutes on 2 H200s
#   GPU_CHECK_LOGS=DIR scripts/gpu_check.sh
#   GPU_CHECK_ONLY="compiled_8l megakernel" scripts/gpu_check.sh   # these items only
#
# With 2+ GPUs the compiled and megakernel runs use the 8-layer Qwen3-30B-A3B config
# (FSDP 2 + EP 2); with one GPU, the debug config at EP 1 and no megakernel run (the GPU
# tests run the megakernel, compiled too, on virtual ranks). Each item has a time limit
# (GPU_CHECK_ITEM_TIMEOUT seconds, default 300), so a hang fails its item instead of the
# whole check. Exit status: the number of failures.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PATH="$PWD/.venv/bin:$PATH"; fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())') || exit 2
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: no CUDA GPU here (the CPU suite is scripts/test.sh)" >&2
  exit 2
fi
logs=${GPU_CHECK_LOGS:-outputs/gpu_check}
limit=${GPU_CHECK_ITEM_TIMEOUT:-300}
rm -rf "$logs" && mkdir -p "$logs"
echo "gpu_check: $gpus x $(python3 -c 'import torch; print(torch.cuda.get_device_name())'), logs in $logs"

failures=0
summary=()
# item NAME DETAIL-COMMAND -- COMMAND...: runs COMMAND (log: $logs/NAME.log), then
# DETAIL-COMMAND on the log for the line's detail (e.g. the parity verdict).
item() {
  local name=$1 detail=$2 status start elapsed
  shift 3
  if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then return; fi
  start=$(date +%s)
  echo "gpu_check: $name ..."
  if timeout --kill-after=30 "$limit" "$@" > "$logs/$name.log" 2>&1; then status=PASS; else status=FAIL; fi
  elapsed=$(( $(date +%s) - start ))
  [ "$status" = PASS ] || failures=$((failures + 1))
  summary+=("$(printf '%-4s %-14s %4ss  %s' "$status" "$name" "$elapsed" "$($detail "$logs/$name.log")")")
  echo "gpu_check: ${summary[-1]}"
}
pytest_tail() { grep -E '(passed|failed|error)' "$1" | tail -1; }
parity_lines() { grep -E '^\[parity\] (verdict|throughput)' "$1" | sed 's/^\[parity\] //' | tr '\n' ' '; }
last_step() { grep -oE 'step: *[0-9]+ +loss: *[0-9.]+' "$1" | tail -1; }
bench_lines() { grep -E 'bitwise|uniep\[|torchtitan\[' "$1" | tr -s ' ' | head -4 | tr '\n' ';'; }

# A compiled run passes when its runs train, even if its short bf16 verdict is drift
# (loss_parity.py exits 1 for drift, 3 for a failed training); the verdict is printed
# on the line.
trains=(bash -c 'python3 scripts/loss_parity.py "$@"; [ $? -le 1 ]' trains)

item gpu_tests pytest_tail -- python3 -m pytest -q -x tests/kernels/test_gpu.py
if [ "$gpus" -ge 2 ]; then
  item main_job parity_lines -- python3 scripts/loss_parity.py run train_configs/qwen3_moe_debug.toml \
    --out "$logs/main_job"
  item compiled_8l parity_lines -- "${trains[@]}" run train_configs/qwen3_30b_a3b_8l.toml --out "$logs/compiled_8l" \
    --no-wandb --training.steps 12 --compile.enable
  item megakernel last_step -- scripts/run_train.sh train_configs/qwen3_30b_a3b_8l.toml \
    --job.dump_folder "$logs/megakernel" --metrics.disable_color_printing --training.steps 6 --compile.enable --uniep.transport megakernel
  item bench_ep bench_lines -- torchrun --standalone --nproc-per-node "$gpus" scripts/bench_ep.py \
    --shapes qwen3 --tokens-per-gpu 4096 --warmup 2 --iters 5
else
  item main_job parity_lines -- python3 scripts/loss_parity.py run train_configs/qwen3_moe_debug.toml \
    --out "$logs/main_job" --parallelism.expert_parallel_degree 1
  item compiled parity_lines -- "${trains[@]}" run train_configs/qwen3_moe_debug.toml --out "$logs/compiled" \
    --no-wandb --parallelism.expert_parallel_degree 1 --compile.enable
  item bench_moe bench_lines -- python3 scripts/bench_moe.py --shapes qwen3 --warmup 2 --iters 5
fi

echo
echo "gpu_check summary ($gpus GPU(s), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')):"
printf '  %s\n' "${summary[@]}"
exit "$failures"
