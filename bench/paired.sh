# Helpers for the bench/compare_*.sh scripts, which run dtrain and its PyTorch peer alternately in one
# command and report, per point, the median of the paired ratios (dtrain / PyTorch of each round).
# Pairing cancels the slow drift of a shared VM's speed: both sides of a round see about the same machine.
# Sourced, not run:  . "$(dirname "$0")/paired.sh"

# median: the median of the numbers on stdin, one per line.
median() { sort -g | awk '{a[NR] = $1} END {if (NR == 0) exit 1; print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2}'; }

# ratios A_LIST B_LIST: a/b for each pair of the two space-separated lists, one per line.
ratios() {
  awk -v a="$1" -v b="$2" 'BEGIN {
    n = split(a, x, " "); m = split(b, y, " ")
    if (n != m) { print "ratios: " n " values against " m > "/dev/stderr"; exit 1 }
    for (i = 1; i <= n; i++) printf "%.4f\n", (y[i] > 0 ? x[i] / y[i] : 0)
  }'
}

# ratio_summary A_LIST B_LIST: "median (min-max)" of the paired ratios a/b, three significant digits.
ratio_summary() {
  local r
  r=$(ratios "$1" "$2")
  printf '%.3g (%.3g-%.3g)' "$(median <<<"$r")" "$(sort -g <<<"$r" | head -1)" "$(sort -g <<<"$r" | tail -1)"
}

# check_count SCRIPT WHAT VALUE: returns when VALUE is a positive integer; otherwise says so in one line naming
# the script and WHAT, and exits 2 (a first argument such as --help must not start a long run).
check_count() {
  [[ $3 =~ ^[1-9][0-9]*$ ]] && return 0
  echo "$1: '$3': expected $2, a positive integer" >&2
  exit 2
}

# need_executables SCRIPT VARIABLES FILE...: returns when every FILE is an executable; otherwise names the first
# that is not in one line (SCRIPT, and the VARIABLES that choose them) and exits 2.
need_executables() {
  local script=$1 variables=$2 f
  shift 2
  for f in "$@"; do
    [ -x "$f" ] || { echo "$script: $f is not an executable (set $variables)" >&2; exit 2; }
  done
}

# stamp: each line of stdin, prefixed with the time it was read (seconds since the epoch, microseconds); no
# fork per line.
stamp() { while IFS= read -r line; do echo "$EPOCHREALTIME $line"; done; }

# list_median LIST: the median of a space-separated list.
list_median() { tr ' ' '\n' <<<"$1" | grep . | median; }

# bench_header PYTHON COMMAND: what the doc records beside a table: date, load, machine, commit, torch version.
bench_header() {
  local repo
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  echo "# date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  echo "# load: $(uptime | sed 's/.*load average: //')"
  echo "# machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), $(uname -r)"
  echo "# commit: $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)$(git -C "$repo" diff --quiet HEAD -- bench 2>/dev/null || echo ' (bench/ modified)')"
  echo "# PyTorch peer: $("$1" -c 'import sys, torch; print("torch", torch.__version__, "python", sys.version.split()[0])' 2>&1 | tail -1) ($1)"
  echo "# command: $2"
}

# find_peers: the directory with run_torch_peer.sh (shared/peers beside or inside the checkout).
find_peers() {
  local repo d
  repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
  for d in "${PEERS:-}" "$repo/shared/peers" "$repo/../shared/peers"; do
    [ -n "$d" ] && [ -e "$d/run_torch_peer.sh" ] && { echo "$d"; return; }
  done
  echo "$repo/../shared/peers"
}

# in_host NAMESPACE HOSTNAME COMMAND...: runs COMMAND in a network namespace as a host of that name (a
# UTS namespace of its own), for the benches that build hosts out of namespaces (two_hosts.sh,
# host_faults.sh).
in_host() {
  local where=$1 name=$2
  shift 2
  ip netns exec "$where" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$name" "$@"
}
