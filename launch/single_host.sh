#!/usr/bin/env bash
# One host, all its local devices (CPU, one or more GPUs, or one TPU VM host).
#   launch/single_host.sh configs/smollm2_dspark.py [--config.key=value ...]
set -euo pipefail
CONFIG=${1:?usage: $0 configs/NAME.py [--config.key=value ...]}; shift
cd "$(dirname "$0")/.."
# Let XLA use all host cores for CPU runs; harmless elsewhere.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_cpu_multi_thread_eigen=true"
exec python -m dspark_jax.train --config "$CONFIG" "$@"
