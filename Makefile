# Entry points: `make run` (the product on an embedded preset), `make run-sglang` (the product
# inside `sglang generate`) and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# Second environment: the released sglang (CPU-only import set) next to causalkv, for tests/sglang_bridge.
SGL_VENV ?= .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
SGL_STAMP := $(SGL_VENV)/.installed
# Third: vLLM-Omni 0.30.0 (vllm 0.30.0, CPU torch), for tests/vllm_omni_bridge. 6.6 GB and ~6
# minutes to build, so it lives outside the checkout, keyed by a hash of its pinned
# requirements: a second clone (CI's fresh one) reuses it. .venv-vllm-omni links to it.
ENV_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/causalkv/envs
VO_KEY := $(shell cat requirements/vllm-omni.txt | sha256sum | cut -c1-12)
VO_ENV := $(ENV_CACHE)/vllm-omni-$(VO_KEY)
VO_VENV ?= .venv-vllm-omni
VO_BIN := $(VO_VENV)/bin

.PHONY: run run-sglang run-vllm-omni test test-sglang test-vllm-omni lint bench venv venv-sglang venv-vllm-omni clean

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

$(SGL_STAMP): pyproject.toml requirements/sglang.txt
	test -x $(SGL_BIN)/python || $(PY) -m venv $(SGL_VENV)
	$(SGL_BIN)/python -m pip install --upgrade pip
	# torch first, pinned (the CPU build on disk); then sglang's import set without its GPU deps.
	$(SGL_BIN)/python -m pip install torch==2.13.0
	$(SGL_BIN)/python -m pip install --no-deps -r requirements/sglang.txt
	# causalkv as a distribution, so sglang finds its entry point.
	$(SGL_BIN)/python -m pip install --no-deps -e .
	touch $(SGL_STAMP)

venv-sglang: $(SGL_STAMP)

# no prerequisite: the folder name is the requirements' hash, so a fresh clone's newer files
# never make it stale
$(VO_ENV)/.installed:
	test -x $(VO_ENV)/bin/python || $(PY) -m venv $(VO_ENV)
	$(VO_ENV)/bin/python -m pip install --upgrade pip
	# torch first, pinned (the CPU build on disk); vllm 0.30.0's torch==2.13.0 pin then keeps it.
	$(VO_ENV)/bin/python -m pip install torch==2.13.0
	$(VO_ENV)/bin/python -m pip install -r requirements/vllm-omni.txt
	touch $@

# The cached environment, linked as .venv-vllm-omni, with causalkv installed from THIS checkout
# (--no-deps -e ., a few seconds; redone whenever the checkout's folder or pyproject.toml
# differs from the last install's, so every clone gets its own code and entry points).
venv-vllm-omni: $(VO_ENV)/.installed
	ln -sfn $(VO_ENV) $(VO_VENV)
	@want="$(CURDIR) $$(sha256sum pyproject.toml | cut -c1-12)"; \
	if [ "$$(cat $(VO_ENV)/.causalkv-source 2>/dev/null)" != "$$want" ]; then \
	  echo "installing causalkv from $(CURDIR) into $(VO_ENV)"; \
	  $(VO_ENV)/bin/python -m pip install -q --no-deps -e . && echo "$$want" > $(VO_ENV)/.causalkv-source; \
	fi

# A LongLive-2.0-like two-shot video (1,024 tokens per chunk, scene cut pinned) with the int2
# packed cache, compared with the bf16 cache on the same seed; the last lines are the summary.
# float32 compute with bf16 caches: CPUs without bf16 instructions run bf16 matmuls ~10x slower.
run: $(STAMP)
	$(BIN)/causalkv generate --model tiny-longlive2-1k \
	  --prompt "A red fox trots through fresh snow in a pine forest at dawn" \
	  --prompt "A neon-lit city street at night in the rain" \
	  --dtype float32 --kv-cache-dtype bfloat16 \
	  --kv-cache-quant int2 --kv-cache-quant-keep-recent 0 --compare-bf16 --quiet \
	  --output out/tiny-longlive2-1k.mp4 --metrics out/tiny-longlive2-1k-metrics.json

# causalkv inside sglang's runtime: the tiny LongLive 2.0 checkpoint (random weights) in
# sglang's own format, two shots, off vs int2 on the same seed, each timed warm; the last lines
# are the summary. PYTHONPATH brings the CPU stand-ins for sglang's GPU kernels
# (demo/sglang/cpu_stand_ins, docs/sglang.md) into sglang's processes; never on a GPU machine.
run-sglang: $(SGL_STAMP)
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/demo/sglang/cpu_stand_ins \
	  $(SGL_BIN)/python demo/sglang/run_int2_vs_off.py --out out/sglang

# causalkv inside vLLM-Omni 0.30.0 on a CPU, through vLLM-Omni's own offline entry point:
# `Omni(model=DIR).generate` on the tiny `causalkv vllm-omni-checkpoint` folder (random weights),
# one Omni instance per setting (off, int4, int2) in one process; the last lines are the table
# (cache class, KV bytes against vLLM-Omni's dense cache, video PSNR vs off as drift).
# PYTHONPATH brings the CPU stand-ins (demo/vllm_omni/cpu_stand_ins, docs/vllm_omni.md); never
# on a GPU machine.
run-vllm-omni: venv-vllm-omni
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/demo/vllm_omni/cpu_stand_ins \
	  $(VO_BIN)/python demo/vllm_omni/run_offline.py

test: $(STAMP)
	$(BIN)/ruff check causalkv tests benchmarks demo
	# the layers (docs/design.md, "Layers"): lower layers never import higher ones, no cycles
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -n 2 --dist loadfile -q
	$(MAKE) test-sglang
	$(MAKE) test-vllm-omni

# The bridge against the released sglang: our tests, then sglang's own unit tests with the hooks on.
test-sglang: $(SGL_STAMP)
	HF_HUB_OFFLINE=1 $(SGL_BIN)/python tests/sglang_bridge/run.py

# The vLLM-Omni bridge against the released vllm-omni 0.30.0 (tests/vllm_omni_bridge/run.py).
test-vllm-omni: venv-vllm-omni
	HF_HUB_OFFLINE=1 $(VO_BIN)/python tests/vllm_omni_bridge/run.py

lint: $(STAMP)
	$(BIN)/ruff check causalkv tests benchmarks demo
	$(BIN)/lint-imports

bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/codec.py
	$(BIN)/python benchmarks/cache.py
	$(BIN)/python benchmarks/plugins.py
	$(BIN)/python benchmarks/generate.py
	# the figures of docs/benchmarks.md (reruns codec.py --only quality and generate.py as JSON)
	$(BIN)/python benchmarks/report.py --out docs/figures

clean:
	rm -rf $(VENV) $(SGL_VENV) out .pytest_cache
	rm -f $(VO_VENV)  # the link only: the cached environment stays for the next clone
