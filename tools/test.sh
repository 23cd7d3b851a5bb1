#!/usr/bin/env bash
# `make test`, what CI runs (.ci/run): the three environments, ruff, the layer check and the
# three suites (the vLLM-Omni suite in the background, beside the main and sglang suites). Each
# phase prints one `phase` line with its wall time as it ends, each suite its 20 slowest tests,
# and the end repeats every phase with the total. An environment, ruff or the layer check that
# fails stops the run; a suite that fails does not stop the others, and the run exits with the
# first failure's status.
#
#   PY=python3.11 bash tools/test.sh     # the Python the environments are built from
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
DURATIONS=${CAUSALKV_DURATIONS:-20}
summary=()
status=0
t_all=$(date +%s%N)

fmt() {  # nanoseconds -> m:ss
  local s=$(( $1 / 1000000000 ))
  printf '%d:%02d' $((s / 60)) $((s % 60))
}

report() {
  echo
  echo "make test: phases (wall time)"
  printf '  %s\n' "${summary[@]}"
  echo "  total $(fmt $(( $(date +%s%N) - t_all )))"
}
trap report EXIT

phase() {  # phase [--go-on] NAME CMD...: run CMD, then one line with its wall time
  local go_on=0
  if [ "$1" = --go-on ]; then
    go_on=1
    shift
  fi
  local name=$1
  shift
  local t0 rc line
  t0=$(date +%s%N)
  "$@"
  rc=$?
  line=$(printf 'phase %-18s %6s  %s' "$name" "$(fmt $(( $(date +%s%N) - t0 )))" \
    "$([ "$rc" = 0 ] && echo ok || echo "FAILED (exit $rc)")")
  echo "$line"
  summary+=("$line")
  if [ "$rc" != 0 ]; then
    [ "$status" != 0 ] || status=$rc
    [ "$go_on" = 1 ] || exit "$status"
  fi
}

phase "env main" "$PY" tools/env.py main .venv
phase "env sglang" "$PY" tools/env.py sglang .venv-sglang
phase "env vllm-omni" "$PY" tools/env.py vllm-omni .venv-vllm-omni
phase "ruff" .venv/bin/ruff check causalkv tests benchmarks demo tools
# the layers (docs/design.md, "Layers"): lower layers never import higher ones, no cycles
phase "layers" .venv/bin/lint-imports
# The vLLM-Omni suite is one pytest process (about 1.3 cores busy on average), so it runs in the
# background alongside the other two, which keep both cores busy; its output is printed whole
# once it has ended (after the sglang suite), its phase line timing it from its start.
vo_log=$(mktemp "${TMPDIR:-/tmp}/causalkv-vllm-omni-suite.XXXXXX")
(
  phase --go-on "vllm-omni suite" env HF_HUB_OFFLINE=1 .venv-vllm-omni/bin/python \
    tests/vllm_omni_bridge/run.py -m "not slow" --durations="$DURATIONS"
  exit "$status"
) >"$vo_log" 2>&1 &
vo_pid=$!
trap 'kill "$vo_pid" 2>/dev/null; rm -f "$vo_log"; report' EXIT
phase --go-on "main suite" .venv/bin/python -m pytest -n 2 --dist loadfile -q -m "not slow" \
  --durations="$DURATIONS"
# two files at a time: most of its time is sglang processes on one core each
phase --go-on "sglang suite" env HF_HUB_OFFLINE=1 .venv-sglang/bin/python tests/sglang_bridge/run.py \
  -n 2 --dist loadfile -m "not slow" --durations="$DURATIONS"
wait "$vo_pid"
vo_status=$?
cat "$vo_log"  # its output and its phase line, timed in the background from its start to its end
summary+=("$(grep '^phase vllm-omni suite' "$vo_log")")
[ "$status" != 0 ] || status=$vo_status
exit "$status"
