# Two commands set up and use a fresh machine: `make run` and `make test` (see README.md).
SHELL := /bin/bash
PY := .venv/bin/python
TORCH_PIN ?= torch==2.13.0
STAMP := .venv/.installed

.PHONY: run test lint unit venv clean prometheus chromium

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: this machine's local CPU wheel; the package's own range then accepts it.
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	.venv/bin/rollwise run --config examples/guess_number.toml $(ARGS)

lint: $(STAMP)
	.venv/bin/ruff check pipeline envs learner tests grafana
	.venv/bin/ruff format --check pipeline envs learner tests grafana
	.venv/bin/mypy
	.venv/bin/python grafana/generate.py --check
	.venv/bin/python -m pipeline.observability.catalogue --check

unit: $(STAMP)
	.venv/bin/pytest -q -m "not slow" $(PYTEST_ARGS)

# The dashboard test evaluates every panel's PromQL on a real Prometheus (Debian package).
prometheus:
	@command -v prometheus >/dev/null || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends prometheus >/dev/null; } || \
	  echo "warning: could not install prometheus; the Prometheus dashboard test will be skipped"; }

# The inspector's browser tests drive headless Chromium through its driver (Debian packages).
chromium:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null 2>&1 || \
	  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q --no-install-recommends chromium chromium-driver >/dev/null; } || \
	  echo "warning: could not install chromium; the inspector's browser tests will be skipped"; }

test: lint prometheus chromium
	.venv/bin/pytest -q $(PYTEST_ARGS)

clean:
	rm -rf .venv runs .mypy_cache .ruff_cache .pytest_cache
