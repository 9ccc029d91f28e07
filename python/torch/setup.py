"""Builds sluice-torch: Sluice as a torch.distributed.rpc backend (a C++ RpcAgent over libsluice_c).

It builds against the torch already installed, never a second one fetched into an isolated build
environment:

    pip install --no-build-isolation ./python/torch
"""

import os
import pathlib
import shutil
import subprocess
import sys

from setuptools import setup

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# The torch versions this agent was written and tested against (major, minor). Another one is
# refused at build time unless SLUICE_TORCH_ANY_VERSION=1 (RpcAgent is not a stable ABI).
SUPPORTED = {(2, 15)}


def fail(message):
    sys.exit(f"sluice-torch: {message}")


try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:
    fail(
        "builds against the torch already installed, and none is importable by this Python "
        f"({sys.executable}). Install torch, then: pip install --no-build-isolation ./python/torch"
    )

headers = pathlib.Path(torch.__file__).parent / "include/torch/csrc/distributed/rpc/rpc_agent.h"
if not headers.exists():
    fail(f"torch {torch.__version__} has no RPC headers ({headers}): it needs a torch built with distributed support")
version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
if version not in SUPPORTED and os.environ.get("SLUICE_TORCH_ANY_VERSION") != "1":
    fail(
        f"torch {torch.__version__} is not a version this agent was built for "
        f"({', '.join(f'{a}.{b}' for a, b in sorted(SUPPORTED))}); set SLUICE_TORCH_ANY_VERSION=1 to try anyway"
    )

# Sluice's C library, built by cargo and shipped beside the extension (found through $ORIGIN);
# or one built elsewhere, named by SLUICE_C_LIB (a GPU machine without the Rust toolchain:
# scripts/gpu-check.sh carries it).
package = HERE / "sluice_torch"
prebuilt = os.environ.get("SLUICE_C_LIB")
if prebuilt:
    if not pathlib.Path(prebuilt).is_file():
        fail(f"SLUICE_C_LIB={prebuilt} is not a file")
    shutil.copy2(prebuilt, package / "libsluice_c.so")
else:
    if shutil.which("cargo") is None:
        fail("needs cargo (the Rust toolchain) to build Sluice's C library, or SLUICE_C_LIB naming a built one")
    subprocess.check_call(["cargo", "build", "--release", "-p", "sluice-capi"], cwd=ROOT)
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    if not target.is_absolute():
        target = ROOT / target
    shutil.copy2(target / "release/libsluice_c.so", package / "libsluice_c.so")
(package / "_build.py").write_text(
    "# Written by setup.py: the torch this extension was compiled against.\n"
    f'TORCH_VERSION = "{torch.__version__}"\n'
)

RPC_ONLY = os.environ.get("SLUICE_TORCH_RPC_ONLY") == "1"

setup(
    name="sluice-torch",
    version="0.1.0",
    description="Sluice as a torch.distributed.rpc backend",
    packages=["sluice_torch"],
    package_data={"sluice_torch": ["libsluice_c.so"]},
    ext_modules=[
        CppExtension(
            "sluice_torch._C",
            # SLUICE_TORCH_RPC_ONLY=1: the RPC agent alone (a torch whose c10d Backend API this
            # process group was not written for, such as a GPU machine's own torch).
            ["sluice_torch/csrc/agent.cpp"] + ([] if RPC_ONLY else ["sluice_torch/csrc/process_group.cpp"]),
            define_macros=[("SLUICE_TORCH_RPC_ONLY", "1")] if RPC_ONLY else [],
            include_dirs=[str(ROOT / "capi/include")],
            library_dirs=[str(package)],
            libraries=["sluice_c"],
            extra_compile_args=["-O2"],
            extra_link_args=["-Wl,-rpath,$ORIGIN"],
        )
    ],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=False)},
)
