#!/usr/bin/env bash
# Create a virtual environment with rose-jax installed (editable, with the dev extra).
#   bash scripts/setup.sh [VENV_DIR]        (default .venv)
# jax >= 0.11 needs Python >= 3.12: this prefers 3.12 (what the GPU image runs), from PATH or pyenv.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=""
for cand in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python python3.13 python3 "$HOME"/.pyenv/versions/3.13*/bin/python; do
  if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
    PY=$(command -v "$cand"); break
  fi
done
[ -n "$PY" ] || { echo "setup: no Python >= 3.12 found (jax >= 0.11 needs it); install one and retry" >&2; exit 1; }
echo "setup: $PY ($("$PY" --version)) -> $VENV"
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|optax|chex|brax|mujoco|mujoco-mjx|orbax-checkpoint) ' || true
