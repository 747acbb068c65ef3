# Sourced by the device scripts with their arguments: takes `--out DIR` and `--wheels DIR` out of them (exported as OUT
# and WHEELS; defaults /tmp/out and .whl, or what the environment already says) and leaves the others in ARGS.
#   source "$(dirname "$0")/device_args.sh" "$@"
OUT=${OUT:-/tmp/out}
WHEELS=${WHEELS:-.whl}
ARGS=()
while (($#)); do
  case $1 in
    --out) OUT=${2:?--out DIR}; shift 2 ;;
    --wheels) WHEELS=${2:?--wheels DIR}; shift 2 ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
export OUT WHEELS
