#!/usr/bin/env bash
# TPU pod slice: run the same command on every host of the slice, e.g.
#   gcloud compute tpus tpu-vm ssh $TPU --zone=$ZONE --worker=all \
#     --command="cd dspark_jax && launch/tpu_pod.sh configs/qwen3_14b_dspark.py \
#                --config.target=/mnt/ckpt/Qwen3-14B --config.mesh.fsdp=8"
# jax.distributed.initialize() discovers the slice topology itself (DSPARK_DISTRIBUTED=1).
# Regeneration and the offline feature cache are split across the hosts (each its share, process
# 0 merges); the workdir must be on storage every host can read and write. On a spot or
# pre-emptible slice the SIGTERM reaches the trainer (exec below): every host saves a checkpoint
# at the same step and exits 0; re-running this command resumes from it.
set -euo pipefail
CONFIG=${1:?usage: $0 configs/NAME.py [--config.key=value ...]}; shift
cd "$(dirname "$0")/.."
export DSPARK_DISTRIBUTED=1
# XLA flags for TPU: async collectives fused with compute (FSDP all-gathers / reduce-scatters
# overlap the layer matmuls). libtpu refuses a flag it does not know and the run stops at start;
# tests/test_launch_scripts.py hands these to the libtpu the tpu extra pins.
export LIBTPU_INIT_ARGS="${LIBTPU_INIT_ARGS:-} \
 --xla_tpu_enable_async_collective_fusion=true \
 --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true \
 --xla_tpu_enable_async_collective_fusion_multiple_steps=true \
 --xla_tpu_overlap_compute_collective_tc=true \
 --xla_enable_async_all_gather=true \
 --xla_tpu_enable_async_collective_fusion_fuse_reduce_scatter=true \
 --xla_enable_async_reduce_scatter_fusion=true"
exec python -m dspark_jax.train --config "$CONFIG" "$@"
