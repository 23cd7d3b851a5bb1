# Two entry points: `make run` (main job on the embedded tiny default) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test lint bench venv clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# torch first, pinned: the CPU build on this machine's disk; a range would pull a CUDA build.
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The benchmark peers (extra `bench`), apart from `make test`'s environment.
$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install -e '.[bench]'
	$(BIN)/python -m pip check
	touch $(BENCH_STAMP)

run: $(STAMP)
	$(BIN)/causalkv generate --output out/tiny-wan.mp4 --metrics out/tiny-wan-metrics.json

test: $(STAMP)
	$(BIN)/ruff check causalkv tests benchmarks
	$(BIN)/python -m pytest -n 2 --dist loadfile -q

lint: $(STAMP)
	$(BIN)/ruff check causalkv tests benchmarks

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/codec.py
	$(BIN)/python benchmarks/cache.py
	$(BIN)/python benchmarks/plugins.py

clean:
	rm -rf $(VENV) out .pytest_cache
