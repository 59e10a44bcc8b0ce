# Two commands do everything on a fresh machine: `make run` and `make test`.
# Both (re)build .venv only when pyproject.toml or constraints.txt changed since the last install.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python

.PHONY: run test bench venv clean wheel-check

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned, so nothing resolves a multi-GB CUDA build
	$(PY) -m pip install --quiet -c constraints.txt torch
	# the exact versions CI tests (pyproject.toml's ranges allow others)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/splitserve serve default --prefill-workers 1 --decode-workers 1

test: $(STAMP)
	$(PY) -m pytest -q

# The wheel in a fresh venv outside the repository (torch from the wheel store, the rest at
# constraints.txt's pins), `splitserve serve --config local`, one OpenAI request: about 4.5 minutes.
wheel-check: $(STAMP)
	SPLITSERVE_WHEEL_TEST=1 $(PY) -m pytest -q -p no:cacheprovider tests/test_packaging.py -k fresh_venv

bench: $(STAMP)
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) .cache .pytest_cache
