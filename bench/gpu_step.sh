# Sourced by the one-GPU session scripts: `step LIMIT_S COMMAND...` runs the command under `timeout`, at most its own
# limit and never past BUDGET_S seconds from the script's start (a step with under 20 s left is logged as skipped),
# appending the command, its output, its exit code and seconds to $LOG.
step() {
  local limit=$1 left=$((BUDGET_S - SECONDS)); shift
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 20 ]; then
    echo "### skipped, ${left} s of the budget left: $*" >> "$LOG"
    return
  fi
  echo "### [${SECONDS} s] $*" >> "$LOG"
  local t0=$SECONDS
  timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "### exit $? after $((SECONDS - t0)) s" >> "$LOG"
}
