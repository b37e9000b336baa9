# Sourced by the device scripts: the Python path on the device machine. lark (which the
# compiler needs) is not installed there; it travels as a wheel in .whl/ (docs/gpu.md).
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
