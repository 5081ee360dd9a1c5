#!/usr/bin/env bash
# Stop the dockerd that scripts/ensure-docker.sh started (by its pid file), and nothing else.
set -euo pipefail
PIDFILE=/run/testbed-dockerd.pid
[ -f "$PIDFILE" ] || { echo "docker: no dockerd of ours to stop"; exit 0; }
PID=$(cat "$PIDFILE")
if [ "$(cat "/proc/$PID/comm" 2>/dev/null)" != dockerd ]; then
  rm -f "$PIDFILE"
  echo "docker: our dockerd (pid $PID) is gone"
  exit 0
fi
kill -TERM "$PID"
for _ in $(seq 30); do
  kill -0 "$PID" 2>/dev/null || { rm -f "$PIDFILE"; echo "docker: stopped dockerd (pid $PID)"; exit 0; }
  sleep 1
done
kill -KILL "$PID" 2>/dev/null || true
rm -f "$PIDFILE"
echo "docker: dockerd (pid $PID) killed after 30 s" >&2
