# Source at the start of a device (H200) command after carrying .whl (see ../shared/device/prelude.sh):
# installs the carried Brax/MuJoCo wheels beside the image's packages.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
