"""A two-process loop of no-op ``sluice.rpc.rpc_sync`` calls: the Python call path alone, for
A/B runs and profiling (``perf record`` follows both processes).

    python3 benches/peers/python_noop.py                 # p50 of 200,000 calls
    N=100000 PYTHONPATH=/tmp/old python3 benches/peers/python_noop.py   # an older package
    MODE=cprofile python3 benches/peers/python_noop.py   # the caller's Python under cProfile
    ARGS=1 python3 benches/peers/python_noop.py          # add(1, 2) instead of a no-op

Prints one line: ``p50 X.XX us``.
"""
import os
import socket
import subprocess
import sys
import time


def noop():
    return None


def add(a, b):
    return a + b


# ARGS=1: time `rpc_sync("callee", add, (1, 2))` instead (a call with small plain arguments
# and an int result: the pickled path both ways).
CALL = (add, (1, 2)) if os.environ.get("ARGS") == "1" else (noop, None)


def worker():
    import sluice.rpc as rpc

    rank = int(os.environ["RANK"])
    rpc.init_rpc("caller" if rank == 0 else "callee", rank=rank, world_size=2,
                 options=rpc.RpcBackendOptions(rpc_timeout=120))
    if rank == 0:
        n = int(os.environ.get("N", "200000"))
        func, args = CALL
        for _ in range(2000):
            rpc.rpc_sync("callee", func, args)
        if os.environ.get("MODE") == "cprofile":
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(n):
                rpc.rpc_sync("callee", func, args)
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(15)
        else:
            ts = []
            for _ in range(n):
                t = time.perf_counter_ns()
                rpc.rpc_sync("callee", func, args)
                ts.append(time.perf_counter_ns() - t)
            ts.sort()
            print("p50 %.2f us" % (ts[len(ts) // 2] / 1000))
    rpc.shutdown()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
        sys.exit(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker"],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                       MASTER_PORT=str(port)))
             for r in (0, 1)]
    codes = [p.wait(timeout=600) for p in procs]
    if any(codes):
        sys.exit(f"a worker failed: {codes}")
