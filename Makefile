# Every target does its own set-up on a fresh clone; a second run reinstalls nothing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HAS_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo 0)
ifeq ($(HAS_CUDA),1)
EXTRA := cuda
else
EXTRA := cpu
endif
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_CPU_OMP_THREADS_BIND ?= nobind
export VLLM_NO_USAGE_STATS ?= 1
export DO_NOT_TRACK ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install test test-fast demo lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# Byte-compiled here (not --no-compile, which made this install 69 s against 182 s): a test
	# run starts hundreds of processes, and where PYTHONDONTWRITEBYTECODE is set each would
	# compile torch and vLLM from source again (measured: a slower suite, 2026-11-29).
	$(BIN)/pip install -q -e ".[$(EXTRA),dev]"
	# PyPI's torchvision is a CUDA build; on a CPU torch it breaks transformers' Qwen2 import.
	if [ "$(EXTRA)" = cpu ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra

# The pure tests only: no engine, no process (the marks in tests/conftest.py); under a minute.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not engine and not process and not slow"

demo: $(STAMP)
	$(BIN)/python examples/demo.py

lint: $(STAMP)
	$(BIN)/ruff check asyncroll tests examples bench
	$(BIN)/mypy asyncroll

bench: $(STAMP)
	for b in bench/[a-z]*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info
