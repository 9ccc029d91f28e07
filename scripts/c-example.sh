#!/usr/bin/env bash
# Builds Sluice's C library (capi/) and runs the C example examples/c/echo.c against it: a
# forked echo server and a client that sends a 4 MiB float tensor and a payload, checks every
# byte of the echo, and prints the round-trip time and "ok". Exits nonzero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
target="${CARGO_TARGET_DIR:-$PWD/target}"

cargo build --release -p sluice-capi
cc -O2 -std=c11 -Wall -Wextra -Werror -I capi/include examples/c/echo.c \
  -L "$target/release" -lsluice_c -Wl,-rpath,"$target/release" -lpthread -ldl -lm \
  -o "$target/c-echo"
"$target/c-echo"
