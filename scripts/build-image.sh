#!/usr/bin/env bash
# Build the node image unless an image with the same inputs exists (label testbed.inputs).
# Usage: scripts/build-image.sh IMAGE_TAG BASE_IMAGE VLLM_DIST
set -euo pipefail
cd "$(dirname "$0")/.."
TAG=$1 BASE=$2 DIST=$3
INPUTS=$( { echo "$BASE $DIST"; docker image inspect -f '{{.Id}}' "$BASE" 2>/dev/null || true;
  cat images/node/Dockerfile images/node/testbed-* pyproject.toml "wheelhouse/$DIST/requirements.txt";
  cat wheelhouse/vllm-overlay/vllm-overlay.json 2>/dev/null || true;  # VLLM=: its hash names the files
  find src -name '*.py' -print0 | sort -z | xargs -0 cat; } | sha256sum | cut -c1-16)
if [ "$(docker image inspect -f '{{index .Config.Labels "testbed.inputs"}}' "$TAG" 2>/dev/null || true)" = "$INPUTS" ]; then
  echo "image $TAG up to date (inputs $INPUTS)"
  exit 0
fi
# The 28.x client has no buildx here; its classic builder needs BUILDKIT off.
if docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
OVERLAY=$(python3 -c 'import json,sys; m=json.load(open(sys.argv[1])); print(" + vLLM %s overlay %s" % (m["version"], m["hash"]))' wheelhouse/vllm-overlay/vllm-overlay.json 2>/dev/null || true)
# The overlay's hash ("" for the installed vLLM): a cluster is reused only by a run naming the same code.
CODE=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["hash"])' wheelhouse/vllm-overlay/vllm-overlay.json 2>/dev/null || true)
echo "image: building $TAG from $BASE ($DIST$OVERLAY); log in /tmp/testbed-build.log"
start=$(date +%s)
if ! timeout 1800 docker build -f images/node/Dockerfile --build-arg BASE_IMAGE="$BASE" \
    --build-arg VLLM_DIST="$DIST" --label testbed.inputs="$INPUTS" --label testbed.vllm="$CODE" -t "$TAG" . >/tmp/testbed-build.log 2>&1; then
  tail -n 30 /tmp/testbed-build.log >&2
  echo "image build failed (full log: /tmp/testbed-build.log)" >&2
  exit 1
fi
echo "image $TAG built in $(( $(date +%s) - start )) s"
