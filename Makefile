# Two entry points: `make demo` and `make test`. Each sets itself up idempotently.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/test

.PHONY: demo test lint test-sqlite test-postgres migrate

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

migrate: $(VENV)/.installed
	$(PY) manage.py migrate --noinput

demo: migrate
	$(PY) manage.py up --demo

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m mypy --ignore-missing-imports --check-untyped-defs --disallow-untyped-defs --follow-imports=silent \
		router/app.py router/asgi_io.py router/background.py router/balancer.py router/coldstart.py \
		router/errors.py router/proxy.py router/state.py router/usage.py
	$(PY) manage.py makemigrations --check --dry-run

test-sqlite: $(VENV)/.installed
	$(PY) -m pytest

# The e2e tests run `up` on a SQLite file of their own whatever DATABASE_URL says,
# so the PostgreSQL pass leaves them out rather than running them twice.
test-postgres: $(VENV)/.installed
	DATABASE_URL=$(PG_TEST_URL) SECRET_KEY=test-only $(PY) -m pytest -m "not e2e"

test: lint test-sqlite test-postgres
