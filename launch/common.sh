# Shared by the launchers (sourced, never run): argument errors and checks, and the rerun-after-preemption
# rule. The sourcing script sets PROG (its name, for messages) before calling any of these.

die() {  # message...: one error line naming the script, a pointer to --help, exit 2
  echo "$PROG: error: $*" >&2
  echo "run 'launch/$PROG --help' for usage" >&2
  exit 2
}

need_value() {  # flag, number of remaining args, next arg
  [[ $2 -ge 2 && "$3" != --* ]] || die "$1 needs a value"
}

check_retries() {  # value of --retries
  [[ "$1" =~ ^[0-9]+$ ]] || die "--retries must be a non-negative integer, got '$1'"
}

should_retry() {  # exit status, retries used so far, --retries: true (and says so) for a preempted job to rerun
  if [[ $1 -eq 143 && $2 -lt $3 ]]; then
    echo "$PROG: exit status 143 (preempted, checkpoint saved): resuming, retry $(( $2 + 1 )) of $3" >&2
    return 0
  fi
  return 1
}
