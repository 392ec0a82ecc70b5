# The two set-up commands of the README: `make demo` and `make test`. Both install what they need
# first (idempotent: a stamp file per environment, redone only when its requirements change).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRITON_ENV := .envs/triton
# pip finds the CPU build of this torch through the machine's find-links; on a CUDA box set
# TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit clean

setup: $(VENV)/.installed $(TRITON_ENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e ".[export,dev]"
	touch $@

# Triton runs in its own environment (NumPy < 2 for its python backend). The python-backend stub
# for this Python version has to sit beside libtriton_python.so.
$(TRITON_ENV)/.installed: deploy/triton/requirements.txt
	$(PYTHON) -m venv $(TRITON_ENV)
	$(TRITON_ENV)/bin/pip install -q --upgrade pip
	$(TRITON_ENV)/bin/pip install -q -r deploy/triton/requirements.txt
	@sp=$$($(TRITON_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	 ver=$$($(TRITON_ENV)/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	 cp "$$sp/pytriton/tritonserver/python_backend_stubs/$$ver/triton_python_backend_stub" \
	    "$$sp/pytriton/tritonserver/backends/python/"
	touch $@

demo: setup
	$(BIN)/rtxserve demo

test: setup
	$(BIN)/pytest $(PYTEST_ARGS)

test-unit: setup
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .envs .rtxserve
