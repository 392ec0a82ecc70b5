#!/bin/sh
# Put the python-backend stub for the environment's Python beside libtriton_python.so, where the
# tritonserver of nvidia-pytriton looks for it: `install-stub.sh ENV_DIR` (the Makefile and the
# air-gapped bundle's install.sh both run it).
set -eu
env_dir=$1
sp=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ver=$("$env_dir/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
cp "$sp/pytriton/tritonserver/python_backend_stubs/$ver/triton_python_backend_stub" "$sp/pytriton/tritonserver/backends/python/"
