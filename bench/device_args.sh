# Sourced by the device scripts with their arguments: takes `--out DIR`, `--wheels DIR` and `--commit REV` out of them
# (exported as OUT, WHEELS and COMMIT; defaults /tmp/out, .whl and git's HEAD where the tree has its history, else
# "unknown") and leaves the others in ARGS.
#   source "$(dirname "$0")/device_args.sh" "$@"
OUT=${OUT:-/tmp/out}
WHEELS=${WHEELS:-.whl}
COMMIT=${COMMIT:-}
ARGS=()
while (($#)); do
  case $1 in
    --out) OUT=${2:?--out DIR}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels DIR}; shift 2 ;;
    --commit) COMMIT=${2:?--commit REV}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[[ -n $COMMIT ]] || COMMIT=$(git rev-parse HEAD 2>/dev/null || echo unknown)
export OUT WHEELS COMMIT
