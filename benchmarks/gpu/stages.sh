# Sourced by the device scripts in benchmarks/gpu/ (after device_env.sh, with $OUT set):
# the extension build and the stage loop they share.
#   build_extension [N]   build the CUDA extension (runtime.cuda.build.load); the last N
#                         (5) lines of its output, "extension build S s" the last, on stdout
#                         and in $OUT/build.log
#   run_stages NAME...    run the script's function stage_NAME for each NAME in turn. Every
#                         name is checked first: an unknown one ends the script (exit 2)
#                         before anything runs. With STAMP_LOG set, "[hh:mm:ss] NAME" before
#                         each stage (stdout and $OUT/$STAMP_LOG: `stamp`); with STAGE_TIMES
#                         set, "NAME: S s" after it (stdout and $OUT/$STAGE_TIMES).
#                         Then pack_out, unless NO_PACK is set.
#   pack_out              the device tool brings back at most 8 files from $OUT: with
#                         more, every file there goes into one archive, $OUT/logs.tgz
#                         (`tar xzf logs.tgz` where it comes back), the files removed
build_extension() {
  /usr/bin/time -f "extension build %e s" python3 -c \
    'from runtime.cuda.build import load; load()' 2>&1 | tail -"${1:-5}" | tee "$OUT/build.log"
}

stamp() { echo "[$(date +%T)] $*" | tee -a "$OUT/${STAMP_LOG:-stages.log}"; }

run_stages() {
  local stage started
  for stage in "$@"; do
    if ! declare -F "stage_$stage" >/dev/null; then
      echo "unknown stage '$stage' (stages:$(declare -F | sed -n 's/^declare -f stage_/ /p' \
        | tr -d '\n'))" >&2
      exit 2
    fi
  done
  for stage in "$@"; do
    [ -n "${STAMP_LOG:-}" ] && stamp "$stage"
    started=$SECONDS
    "stage_$stage"
    [ -n "${STAGE_TIMES:-}" ] && echo "$stage: $((SECONDS - started)) s" | tee -a "$OUT/$STAGE_TIMES"
  done
  [ -z "${NO_PACK:-}" ] && pack_out
  return 0
}

pack_out() {
  local count
  count=$(find "$OUT" -type f ! -name logs.tgz | wc -l)
  [ "$count" -le 8 ] && return 0
  (cd "$OUT" && find . -type f ! -name logs.tgz -print0 | sort -z \
     | tar czf logs.tgz --null -T - --remove-files) || return 1
  find "$OUT" -mindepth 1 -type d -empty -delete
  echo "packed $count files into $OUT/logs.tgz"
}
