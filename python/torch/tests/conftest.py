"""Applies skips.txt (tests skipped with their reason) and, with SLUICE_TORCH_SUBSET=FILE, runs
only the tests FILE lists (one `Class.test_name` per line) to PyTorch's generic suites."""

import os
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent


def _entries(path):
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, reason = line.partition(" ")
            yield name, reason.strip()


def pytest_collection_modifyitems(config, items):
    skips = dict(_entries(HERE / "skips.txt"))
    subset = os.environ.get("SLUICE_TORCH_SUBSET")
    wanted = {name for name, _ in _entries(pathlib.Path(subset))} if subset else None
    keep, drop = [], []
    for item in items:
        cls = item.cls.__name__ if item.cls else ""
        key = f"{cls}.{item.name}"
        if wanted is not None and item.module.__name__ == "test_generic" and key not in wanted:
            drop.append(item)
            continue
        if key in skips:
            item.add_marker(pytest.mark.skip(reason=skips[key]))
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
