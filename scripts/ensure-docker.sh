#!/usr/bin/env bash
# Make a Docker engine reachable, within a bound:
# - an engine answering at DOCKER_HOST or the default socket is used as it is;
# - otherwise, as root on Debian, install docker.io if needed and start dockerd
#   (overlay2, no iptables changes), writing its pid to /run/testbed-dockerd.pid.
# Never touches containers or images of an engine that is already running.
set -euo pipefail
WAIT_S=${DOCKER_WAIT_S:-60}
LOG=/var/log/testbed-dockerd.log

if docker info >/dev/null 2>&1; then
  echo "docker: engine reachable ($(docker version --format '{{.Server.Version}}' 2>/dev/null))"
  exit 0
fi
if [ -n "${DOCKER_HOST:-}" ]; then
  echo "Docker engine not reachable at DOCKER_HOST=$DOCKER_HOST: start it there, or unset DOCKER_HOST to use a local one" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "Docker engine not reachable at /var/run/docker.sock and not root: start Docker (e.g. 'sudo systemctl start docker') or set DOCKER_HOST" >&2
  exit 1
fi
if ! command -v dockerd >/dev/null; then
  if ! command -v apt-get >/dev/null; then
    echo "no dockerd and no apt-get: install Docker Engine, then re-run" >&2
    exit 1
  fi
  echo "docker: installing docker.io"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io >/dev/null
fi
echo "docker: starting dockerd (log: $LOG)"
nohup dockerd --storage-driver=overlay2 --iptables=false --ip-masq=false >"$LOG" 2>&1 &
echo $! >/run/testbed-dockerd.pid
for _ in $(seq "$WAIT_S"); do
  if docker info >/dev/null 2>&1; then
    echo "docker: engine up in ${SECONDS} s (pid $(cat /run/testbed-dockerd.pid))"
    exit 0
  fi
  if ! kill -0 "$(cat /run/testbed-dockerd.pid)" 2>/dev/null; then
    echo "dockerd exited; last lines of $LOG:" >&2
    tail -n 20 "$LOG" >&2
    exit 1
  fi
  sleep 1
done
echo "dockerd not answering after ${WAIT_S} s; last lines of $LOG:" >&2
tail -n 20 "$LOG" >&2
exit 1
