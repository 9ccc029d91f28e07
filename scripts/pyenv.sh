# Sourced by python-check.sh and torch-check.sh (from the repository root): sets VENV to the
# project's virtual environment (target/pyenv, or $SLUICE_PYENV) and makes it if missing.
VENV="${SLUICE_PYENV:-$PWD/target/pyenv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" 2>/dev/null || {
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        python3 -m venv "$VENV"
    }
fi
