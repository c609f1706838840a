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
# Optional environments (envs.make("playground:..."), envs.make("gymnax:...")), small and pure Python.
# --no-deps: Playground requires warp-lang (~150 MB, only for impl="warp") and gymnax pins jax<0.12
# (it runs on 0.12); the requirements they need are installed first (mediapy's IPython is not
# needed: Playground does not import mediapy). The --no-deps install comes last on purpose: pip
# checks the whole environment's requirements after every install without --no-deps, so a later
# plain install would print "ERROR: pip's dependency resolver ..." about exactly these expected,
# harmless gaps (warp-lang, jax<0.12, ipython).
"$VENV/bin/python" -m pip install -q lxml "gymnasium>=1.1,<1.4" seaborn six \
  || echo "setup: optional env requirements not installed (their tests will skip)" >&2
"$VENV/bin/python" -m pip install -q --no-deps "playground==0.2.0" "gymnax==1.0.1" ml-collections mediapy \
  || echo "setup: optional Playground/gymnax envs not installed (their tests will skip)" >&2
# Headless rendering on a CPU (rose-jax play): MuJoCo's OSMesa backend needs libOSMesa.
if ! ldconfig -p 2>/dev/null | grep -q libOSMesa; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libosmesa6; } >/dev/null 2>&1 \
      || echo "setup: could not install libosmesa6; rendering on a CPU will not work" >&2
  else
    echo "setup: libOSMesa not found (install libosmesa6) - needed to render videos on a CPU" >&2
  fi
fi
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE '^(jax|jaxlib|flax|optax|chex|brax|mujoco|mujoco-mjx|orbax-checkpoint) ' || true
