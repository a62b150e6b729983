# System libraries the test suite needs beyond Python packages: Mooncake's transfer engine links libibverbs and
# librdmacm even for its TCP transport. Sourced by scripts/test.sh; installs them with apt-get when missing (as
# root), else says what to install. nixl_kv's NIXL agent keeps UCX from loading its IB modules on a host with these
# libraries but no RDMA device (they crash nixl 1.5.1's UCX at exit).
missing=()
for lib in libibverbs.so.1 librdmacm.so.1; do
  ldconfig -p | grep -F "$lib" >/dev/null || missing+=("$lib")  # not -q: an early exit fails the pipe (pipefail)
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "[setup] installing libibverbs1 librdmacm1 (Mooncake's engine links them)" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 librdmacm1; } >/tmp/nixl_kv_apt.log 2>&1 \
      || { cat /tmp/nixl_kv_apt.log >&2; echo "[setup] apt-get failed (log above)" >&2; exit 1; }
  else
    echo "[setup] missing ${missing[*]}: install libibverbs1 and librdmacm1 (Mooncake's tests will be skipped)" >&2
  fi
fi
