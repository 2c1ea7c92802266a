#!/usr/bin/env bash
# After `make env-verifiers` installed requirements-verifiers.txt into VENV: the offline wheel index of
# verifiers' chat harness program (the `null` and `bash` harnesses: a PEP 723 script that verifiers'
# subprocess runtime prepares with `uv sync --script`).
#
# Why: rollwise's sandbox has no network, and uv cannot use a read-only cache (it locks it), so each
# episode's uv builds the script's environment in the sandbox's own directory from a local index:
# VENV/wheelhouse (the wheels, the versions the venv itself pins) and VENV/wheelhouse-index (a PEP 503
# index over them, which envs/ecosystems/verifiers_runner.py hands uv as UV_DEFAULT_INDEX). Then the
# script is prepared once here, offline, exactly as an episode will, so a broken index fails the build.
set -euo pipefail
venv=${1:?usage: after-install-verifiers.sh VENV}
python="$venv/bin/python"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The chat program's declared dependencies, each at the version the venv resolved (pip then adds what
# they need, as wheels only).
"$python" - "$work/program.py" "$work/requirements.txt" <<'PY'
import re, sys
from importlib.metadata import version
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE

with open(sys.argv[1], "w") as out:
    out.write(CHAT_PROGRAM_SOURCE)
header = CHAT_PROGRAM_SOURCE.split("# ///\n", 2)[0]
declared = re.search(r"# dependencies = \[(.*?)\]", header).group(1)
names = [re.split(r"[=<>!~ \[]", item.strip().strip('"'))[0] for item in declared.split(",") if item.strip()]
with open(sys.argv[2], "w") as out:
    out.writelines(f"{name}=={version(name)}\n" for name in names)
PY

rm -rf "$venv/wheelhouse" "$venv/wheelhouse-index"
"$python" -m pip download -q --only-binary=:all: -d "$venv/wheelhouse" -r "$work/requirements.txt"

"$python" - "$venv/wheelhouse" "$venv/wheelhouse-index" <<'PY'
import html, re, sys
from pathlib import Path

wheels, index = Path(sys.argv[1]), Path(sys.argv[2])
projects = {}
for wheel in sorted(wheels.glob("*.whl")):
    projects.setdefault(re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower(), []).append(wheel)
for name, files in projects.items():
    (index / name).mkdir(parents=True)
    links = "".join(f'<a href="{w.resolve().as_uri()}">{html.escape(w.name)}</a>\n' for w in files)
    (index / name / "index.html").write_text(f"<!DOCTYPE html>\n<html><body>\n{links}</body></html>\n")
PY

# Every user may read it: a root daemon's sandboxes run as an unprivileged uid.
chmod -R a+rX "$venv"

UV_CACHE_DIR="$work/uv-cache" UV_DEFAULT_INDEX="file://$venv/wheelhouse-index" UV_PYTHON="$python" \
  UV_PYTHON_DOWNLOADS=never UV_OFFLINE=false HOME="$work" \
  "$venv/bin/uv" sync --script "$work/program.py" -q --no-config
echo "verifiers: chat harness wheels in $venv/wheelhouse ($(ls "$venv/wheelhouse" | wc -l) wheels), prepared offline"
