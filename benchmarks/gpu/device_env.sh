# Sourced by the device scripts: the Python path on the device machine. lark (which the
# compiler needs) is not installed there; it travels as a wheel in .whl/ (docs/gpu.md).
# Two scripts started at once (e.g. one on GPU 3 beside one on GPUs 0-1) share /tmp/site:
# the install holds a lock, and a script finding the wheels installed skips it (an
# unlocked second `pip install --upgrade` removed files the first was writing).
# EXTRA_PYTHONPATH: more folders for optional peers (torchao installed with --target).
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16}
if ls .whl/*.whl >/dev/null 2>&1; then
  (
    command -v flock >/dev/null && flock 9
    if [ ! -f /tmp/site/.modulec-wheels ] || ! cmp -s /tmp/site/.modulec-wheels <(ls .whl/*.whl); then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && ls .whl/*.whl > /tmp/site/.modulec-wheels
    fi
  ) 9>/tmp/site.lock && export PYTHONPATH=/tmp/site:$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} || exit 1
else
  export PYTHONPATH=$PWD${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}
fi
