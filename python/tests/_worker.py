"""One worker of a test group: runs scenarios.<name>(rank, world)."""

import sys
import threading
import os

import scenarios


def watchdog():
    # Belt and braces: the fixture kills the group too, but a worker must never outlive it.
    os._exit(3)


if __name__ == "__main__":
    timer = threading.Timer(float(os.environ.get("SLUICE_TEST_WATCHDOG", "120")) + 10, watchdog)
    timer.daemon = True
    timer.start()
    getattr(scenarios, sys.argv[1])(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    print("scenario done", flush=True)
