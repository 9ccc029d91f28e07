"""Runs a test's body in real, spawned processes under a watchdog (shared by the test modules)."""

import os
import tempfile
import time

import pytest
import torch.multiprocessing as mp

WATCHDOG_S = 120


def run(fn, world, *args, expect_exit=None):
    """Runs `fn(rank, world, init_method, *args)` in `world` spawned processes; every one must
    exit 0 (or with `expect_exit[rank]`; None: any code) within the watchdog."""
    init = "file://" + tempfile.mktemp(prefix="sluice-torch-")
    ctx = mp.start_processes(_entry, args=(fn, world, init, *args), nprocs=world, join=False, start_method="spawn")
    want = expect_exit or [0] * world
    deadline = time.monotonic() + WATCHDOG_S
    while not all(p.exitcode is not None for p in ctx.processes):
        wrong = [
            (r, p.exitcode)
            for r, p in enumerate(ctx.processes)
            if p.exitcode is not None and want[r] is not None and p.exitcode != want[r]
        ]
        if wrong or time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            if wrong:
                pytest.fail(f"worker {wrong[0][0]} exited with {wrong[0][1]} (its traceback is above); the others were killed")
            pytest.fail(f"watchdog: workers still running after {WATCHDOG_S} s (a hang)")
        time.sleep(0.05)
    codes = [p.exitcode for p in ctx.processes]
    assert all(w is None or c == w for c, w in zip(codes, want)), f"exit codes {codes}, expected {want}"


def _entry(rank, fn, *args):
    try:
        fn(rank, *args)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
