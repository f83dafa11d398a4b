# Shared by the launchers (sourced, never run): argument parsing, errors and checks, the dry-run-aware
# `run`, and the rerun-after-preemption rule. The sourcing script sets PROG (its name, for messages)
# before calling any of these.

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

parse_flags() {  # "$@" of the script: fills the variables that VALUE_FLAGS / SWITCHES (associative arrays,
  # flag -> variable name; declared by the script) name, and EXTRA with the words after "--"
  while [[ $# -gt 0 ]]; do
    if [[ -n "$1" && -n "${VALUE_FLAGS[$1]+set}" ]]; then
      need_value "$1" $# "${2-}"; printf -v "${VALUE_FLAGS[$1]}" '%s' "$2"; shift 2
    elif [[ -n "$1" && -n "${SWITCHES[$1]+set}" ]]; then
      printf -v "${SWITCHES[$1]}" '%s' 1; shift
    else
      case "$1" in
        -h|--help) usage; exit 0 ;;
        --) shift; EXTRA=("$@"); return 0 ;;
        *) die "unknown argument '$1'" ;;
      esac
    fi
  done
}

run() {  # print (DRY_RUN=1) or run one command, shown shell-quoted
  if [[ $DRY_RUN -eq 1 ]]; then
    printf '+'; printf ' %q' "$@"; printf '\n'
  else
    { printf '+'; printf ' %q' "$@"; printf '\n'; } >&2
    "$@"
  fi
}
