#!/usr/bin/env python3
"""Runs PyTorch's generic RPC suites against the SLUICE backend and reports pass / skip / fail
per suite.

    python run_generic.py ci      # the subset in ci_tests.txt (what CI runs, a few minutes)
    python run_generic.py full    # every test of GENERIC_TESTS (about 50 minutes on 2 cores)
    python run_generic.py cuda    # PyTorch's CUDA suites (a GPU machine: scripts/gpu-check.sh)

Exits non-zero if any test failed. Extra arguments go to pytest (`-k test_self_add`).
"""

import collections
import os
import pathlib
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "ci"
    if which not in ("ci", "full", "cuda"):
        sys.exit(__doc__)
    env = dict(os.environ)
    # A hung test fails after this many seconds instead of PyTorch's default 300.
    env.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
    if which == "ci":
        env["SLUICE_TORCH_SUBSET"] = str(HERE / "ci_tests.txt")
    report = HERE / f".generic-{which}.xml"
    module = "test_generic_cuda.py" if which == "cuda" else "test_generic.py"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", module, f"--junitxml={report}"]
    run = subprocess.run(cmd + sys.argv[2:], cwd=HERE, env=env)
    counts = collections.defaultdict(collections.Counter)
    failed = []
    for case in ET.parse(report).getroot().iter("testcase"):
        suite = case.get("classname", "").rsplit(".", 1)[-1]
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                failed.append(f"{suite}.{case.get('name')}")
            elif child.tag == "skipped":
                outcome = "skipped"
        counts[suite][outcome] += 1
    print(f"\nPyTorch's generic RPC suites on the SLUICE backend ({which}):")
    print(f"{'suite':44} {'passed':>7} {'skipped':>8} {'failed':>7}")
    total = collections.Counter()
    for suite in sorted(counts):
        c = counts[suite]
        total.update(c)
        print(f"{suite:44} {c['passed']:7} {c['skipped']:8} {c['failed']:7}")
    print(f"{'total':44} {total['passed']:7} {total['skipped']:8} {total['failed']:7}")
    for f in failed:
        print(f"FAILED {f}")
    report.unlink(missing_ok=True)
    return 1 if failed or run.returncode not in (0, 5) else 0


if __name__ == "__main__":
    sys.exit(main())
