#!/bin/sh
# `harbor run` (Harbor's own CLI, from its venv) on rollwise's bubblewrap runtime, no Docker:
#
#     envs/ecosystems/harbor-run.sh -p envs/harbor_tasks -a oracle
#
# Every argument goes to `harbor run` after `--env envs.ecosystems.harbor_bwrap_runtime:BwrapEnvironment`
# (docs/plugins.md, "Harbor's own CLI"). The venv is $ROLLWISE_ECOSYSTEM_VENVS/harbor (default
# ~/.cache/rollwise/venvs/harbor, /opt/rollwise/venvs/harbor for root; built by `make env-harbor`);
# this checkout goes on PYTHONPATH so Harbor can import the runtime, and LiteLLM (imported by Harbor's
# CLI) reads its bundled model cost map instead of fetching one from the network.
set -eu
repo=$(cd "$(dirname "$0")/../.." && pwd)
if [ "$(id -u)" = 0 ]; then default=/opt/rollwise/venvs; else default=$HOME/.cache/rollwise/venvs; fi
venvs=${ROLLWISE_ECOSYSTEM_VENVS:-$default}
harbor=$venvs/harbor/bin/harbor
if [ ! -x "$harbor" ]; then
  echo "harbor-run.sh: $harbor is missing: run \`make env-harbor\` in $repo" >&2
  exit 2
fi
export LITELLM_LOCAL_MODEL_COST_MAP=True
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$harbor" run --env envs.ecosystems.harbor_bwrap_runtime:BwrapEnvironment "$@"
