"""Fixtures: worker groups in real processes, with the variables torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and a pipe echo peer in its own process.

Every process gets a watchdog: a group that has not finished in time is killed and the test
fails with its output (a deadlock shows as a failure, not a hung CI)."""

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WATCHDOG = float(os.environ.get("SLUICE_TEST_WATCHDOG", "120"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(scenario, world=2, extra_path=None, env=None):
    """Runs ``scenarios.<scenario>(rank, world)`` in ``world`` processes; returns their
    outputs; fails the test if any exits nonzero or the group outlives the watchdog."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ)
        e.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([HERE] + ([extra_path] if extra_path and rank == 0 else [])),
        )
        e.update(env or {})
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.join(HERE, "_worker.py"), scenario],
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = []
    failed = []
    for rank, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=WATCHDOG)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            failed.append(f"rank {rank} still running after {WATCHDOG} s (watchdog)")
        if p.returncode != 0:
            failed.append(f"rank {rank} exited {p.returncode}")
        outputs.append(out)
    if failed:
        report = "\n".join(f"--- rank {r} ---\n{o}" for r, o in enumerate(outputs))
        pytest.fail("; ".join(failed) + "\n" + report)
    return outputs


@pytest.fixture
def group():
    return run_group


@pytest.fixture
def echo_peer():
    """A process that accepts one pipe and echoes every message until the pipe closes;
    yields its address."""
    p = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_echo_peer.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=HERE),
    )
    address = p.stdout.readline().strip()
    assert address, p.stderr.read()
    yield address
    try:
        p.wait(timeout=WATCHDOG)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("the echo peer did not exit (watchdog)")
    assert p.returncode == 0, p.stderr.read()
