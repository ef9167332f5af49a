# Two entry points: `make demo` and `make test`. Both create what they need from nothing.
PYTHON ?= python3
VENV ?= .venv
TFVENV ?= .venv-tf
BIN := $(VENV)/bin
PIP_FLAGS ?= -q --disable-pip-version-check

.PHONY: demo test lint typecheck pytest bench clean prometheus

$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade pip
	# pyproject asks for ranges; constraints.txt pins what we test (torch: the CPU build). The
	# editable install maps geoshard.loaders to loaders/ and geoshard.trainer to trainer/ with an
	# import finder, so a new file in any of the three folders imports at once, with no reinstall.
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test]'
	touch $@

# TensorFlow interop runs in its own venv: tensorflow-io 0.37 pins numpy<2 and TF 2.16.
$(TFVENV)/.installed: constraints.txt
	test -x $(TFVENV)/bin/python || $(PYTHON) -m venv $(TFVENV)
	$(TFVENV)/bin/python -m pip install $(PIP_FLAGS) -c constraints.txt tensorflow-cpu tensorflow-io
	touch $@

demo: $(BIN)/.installed
	$(BIN)/geoshard demo --out demo-out

lint: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check geoshard loaders trainer

typecheck: $(BIN)/.installed
	$(BIN)/mypy

# The Grafana dashboard's queries are tested against a real Prometheus: Debian's package.
prometheus:
	command -v prometheus >/dev/null || (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus)

pytest: $(BIN)/.installed $(TFVENV)/.installed prometheus
	GEOSHARD_TF_PYTHON=$(abspath $(TFVENV))/bin/python $(BIN)/pytest -q

test: lint typecheck pytest

$(BIN)/.bench-installed: $(BIN)/.installed
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[test,bench]'
	$(BIN)/python -m pip check
	touch $@

bench: $(BIN)/.bench-installed
	$(BIN)/python bench/split_bench.py
	$(BIN)/python bench/sync_bench.py
	$(BIN)/python bench/loader_bench.py
	$(BIN)/python bench/iowait_bench.py

clean:
	rm -rf demo-out build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
