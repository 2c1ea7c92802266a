#!/bin/bash
# Run by `make env-openenv` once the pins are installed, with the venv's directory: installs the echo
# environment of `openenv init`'s template into the venv as the distribution openenv-echo_env (module
# echo_env), so that `openenv/echo_env` runs with no further step and the tests play the template for real.
# Its generated source stays in <venv>/share/rollwise/echo_env.
set -euo pipefail
venv=$1
src="$venv/share/rollwise"
rm -rf "$src/echo_env"
mkdir -p "$src"
"$venv/bin/openenv" init echo_env --output-dir "$src" >/dev/null
"$venv/bin/python" -m pip install -q --no-deps "$src/echo_env"
