#!/usr/bin/env bash
# GPUs: one process per host, each driving all of its local GPUs (JAX's recommended layout).
#   Single host, N GPUs:   launch/multi_gpu.sh configs/qwen3_8b_dspark.py --config.target=/ckpt/Qwen3-8B
#   Several hosts (SLURM): srun --nodes=4 --ntasks-per-node=1 launch/multi_gpu.sh CONFIG ...
#   Several hosts (manual): set COORDINATOR=host0:1234 NUM_PROCESSES=4 PROCESS_ID=<i> on each host.
# With more than one process, jax.distributed.initialize() is called by the CLI
# (DSPARK_DISTRIBUTED=1); it reads SLURM's variables itself, or the JAX_* ones set below.
set -euo pipefail
CONFIG=${1:?usage: $0 configs/NAME.py [--config.key=value ...]}; shift
cd "$(dirname "$0")/.."

# Per-topology XLA flags for NVIDIA GPUs: overlap collectives with compute, let the latency-hiding
# scheduler reorder them, and combine small all-reduces/all-gathers (FSDP gradients).
export XLA_FLAGS="${XLA_FLAGS:-} \
 --xla_gpu_enable_latency_hiding_scheduler=true \
 --xla_gpu_enable_highest_priority_async_stream=true \
 --xla_gpu_all_reduce_combine_threshold_bytes=134217728 \
 --xla_gpu_all_gather_combine_threshold_bytes=134217728 \
 --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728"
# Let JAX take most of GPU memory up front (the frozen target + drafter + activations).
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-1}"

if [[ -n "${SLURM_NTASKS:-}" && "${SLURM_NTASKS}" -gt 1 ]] || [[ -n "${COORDINATOR:-}" ]]; then
  export DSPARK_DISTRIBUTED=1
  if [[ -n "${COORDINATOR:-}" ]]; then
    export JAX_COORDINATOR_ADDRESS="$COORDINATOR"
    export JAX_NUM_PROCESSES="${NUM_PROCESSES:?set NUM_PROCESSES}"
    export JAX_PROCESS_ID="${PROCESS_ID:?set PROCESS_ID}"
  fi
fi
exec python -m dspark_jax.train --config "$CONFIG" "$@"
