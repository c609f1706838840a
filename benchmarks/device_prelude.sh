# Source at the start of a command on a GPU machine whose image lacks Brax/MuJoCo (run from the repo
# root, with the wheels in ./.whl; benchmarks/README.md says how to download them): installs them
# beside the image's packages, puts the repository on PYTHONPATH, and keeps JAX from preallocating
# GPU memory (worker processes share the GPU).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
