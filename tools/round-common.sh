# Shared by the round scripts in tools/ (source it; it is not run on its own): the environment a
# GPU round runs in, `step` (one bounded command, its log in $OUT, its tail printed, a failure
# remembered in $status) and `install_jaxgin` (editable install and device-library build).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_TIMEOUT=${JAXGIN_TIMEOUT:-10}
OUT=${OUT:-$(mktemp -d)}
export JAXGIN_RESULTS_DIR=$OUT JAXGIN_CACHE_DIR=${JAXGIN_CACHE_DIR:-/tmp/jaxgin-cache}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
status=0
step() { local limit=$1 name=$2; shift 2; echo "=== $name"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1 || { echo "=== FAILED ($?): $name"; status=1; }; grep -v -i "warning" "$OUT/$name.log" | tail -"${TAIL:-8}"; }
install_jaxgin() {
  python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/install.log" 2>&1 || { tail "$OUT/install.log"; return 1; }
  python3 -m jaxgin.build > "$OUT/build.log" 2>&1 || { tail "$OUT/build.log"; return 1; }
}
