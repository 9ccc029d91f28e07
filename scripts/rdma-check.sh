#!/usr/bin/env bash
# The ibverbs checks that need an RDMA device: the transport conformance suite, the rdma pipe and
# `sluice bench ibverbs` on real hardware, with `ib_write_bw` / `ib_write_lat` beside them when
# perftest is installed. Run it on a host with a device (InfiniBand, RoCE, or SoftRoCE:
# `rdma link add rxe0 type rxe netdev eth0`, which needs a kernel with rdma_rxe).
#
#   scripts/rdma-check.sh                      # automatic device, port and GID
#   SLUICE_IB_DEVICE=mlx5_0 SLUICE_IB_PORT=1 SLUICE_IB_GID_INDEX=3 scripts/rdma-check.sh
#
# Across two hosts (what only shows there: MTU, GID address family and read-depth mismatches
# between two ports, and the fabric itself), one side listens and the other measures pipes over
# ibverbs (basic and rdma channels) against raw TCP between the same hosts:
#
#   scripts/rdma-check.sh listen 0.0.0.0:7000      # on host A
#   scripts/rdma-check.sh connect HOST_A:7000      # on host B
#
# Needs rdma-core (libibverbs) at run time, and cmake + libclang to build the `rdma` feature
# (Debian: apt-get install rdma-core libibverbs1 cmake libclang-dev). A device that is missing or
# unusable fails the run (SLUICE_REQUIRE_RDMA=1): nothing is skipped silently here.
set -euo pipefail
cd "$(dirname "$0")/.."
export SLUICE_REQUIRE_RDMA=1
OUT=${OUT:-target/rdma-check}
mkdir -p "$OUT"

# Registered memory is pinned and counts against RLIMIT_MEMLOCK: each connection pins two 2 MiB
# rings and the rdma channel caches registrations of sent tensors (a quarter of the limit at
# most). Containers often default to 8 MiB; root is not limited.
memlock=$(ulimit -l)
echo "locked-memory limit (ulimit -l): $memlock KiB" | tee "$OUT/memlock.txt"
if [ "$(id -u)" != 0 ] && [ "$memlock" != unlimited ] && [ "$memlock" -lt 65536 ]; then
    echo "RLIMIT_MEMLOCK is below 64 MiB: raise it (ulimit -l unlimited; Docker --ulimit memlock=-1;" \
        "systemd LimitMEMLOCK=infinity) or pipes will fail to register their rings" >&2
    exit 1
fi

case "${1:-}" in
    listen)
        exec cargo run --release --features rdma -- bench --listen "${2:?listen ADDR}"
        ;;
    connect)
        cargo run --release --features rdma -- bench --connect "${2:?connect HOST:PORT}" \
            --suites raw,pipe --json "$OUT/two-hosts.jsonl" 2>&1 | tee "$OUT/two-hosts.txt"
        grep -q "rdma/ibv" "$OUT/two-hosts.txt" || {
            echo "no pipe ran over ibverbs with the rdma channel: see the negotiation messages above" >&2
            exit 1
        }
        exit 0
        ;;
esac

command -v ibv_devinfo >/dev/null && ibv_devinfo | tee "$OUT/devinfo.txt" || echo "(ibv_devinfo not installed)"


# The conformance suite (model and hardware), one test at a time so the hardware is not shared.
cargo test --release -p sluice-tests --features rdma --test ibverbs -- --test-threads=1 --nocapture 2>&1 \
    | tee "$OUT/tests.txt"

# The transport and the rdma channel against raw verbs on the same device.
cargo run --release --features rdma -- bench --suites ibverbs --json "$OUT/bench.jsonl" 2>&1 | tee "$OUT/bench.txt"

# The link's own figures, for the targets (>= 0.9x ib_write_bw for large tensors, <= 1.5x
# ib_write_lat for small messages). Loopback on this host: server and client on one device.
if command -v ib_write_bw >/dev/null; then
    dev_args=()
    [ -n "${SLUICE_IB_DEVICE:-}" ] && dev_args+=(-d "$SLUICE_IB_DEVICE")
    [ -n "${SLUICE_IB_GID_INDEX:-}" ] && dev_args+=(-x "$SLUICE_IB_GID_INDEX")
    for tool in ib_write_bw ib_write_lat; do
        extra=()
        [ "$tool" = ib_write_bw ] && extra=(-s 67108864)
        [ "$tool" = ib_write_lat ] && extra=(-s 64)
        "$tool" "${dev_args[@]}" "${extra[@]}" >"$OUT/$tool.server.txt" 2>&1 &
        server=$!
        sleep 1
        "$tool" "${dev_args[@]}" "${extra[@]}" localhost 2>&1 | tee "$OUT/$tool.txt"
        wait "$server" || true
    done
else
    echo "(perftest not installed: no ib_write_bw / ib_write_lat figures to compare with)"
fi
echo "results in $OUT"
