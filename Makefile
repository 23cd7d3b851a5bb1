# Entry points: `make run` (the product on an embedded preset), `make run-sglang` (the product
# inside `sglang generate`) and `make test`.
PY ?= python3
# Three environments, each made by tools/env.py: third-party packages in layers cached outside
# the checkout (keyed by their pins, built once per machine, torch installed once under all
# three), causalkv from THIS checkout in a small venv of the checkout's own (.venv,
# .venv-sglang, .venv-vllm-omni), so two clones share packages but never each other's code.
ENVTOOL := $(PY) tools/env.py
VENV ?= .venv
BIN := $(VENV)/bin
# Second: the released sglang 0.5.23 (CPU-only import set, requirements/sglang.txt).
SGL_VENV ?= .venv-sglang
SGL_BIN := $(SGL_VENV)/bin
# Third: vLLM-Omni 0.30.0 (vllm 0.30.0, CPU torch; requirements/vllm-omni.txt).
VO_VENV ?= .venv-vllm-omni
VO_BIN := $(VO_VENV)/bin
# `make bench`: the main environment plus the benchmarks' peer quantizers (extra `bench`).
BENCH_VENV ?= .venv-bench
BENCH_BIN := $(BENCH_VENV)/bin

.PHONY: run run-sglang run-vllm-omni test test-long test-sglang test-vllm-omni lint bench venv venv-sglang venv-vllm-omni venv-bench clean

# each is quick when nothing changed (tools/env.py checks its layer and the checkout's venv)
venv:
	@$(ENVTOOL) main $(VENV)

venv-sglang:
	@$(ENVTOOL) sglang $(SGL_VENV)

venv-vllm-omni:
	@$(ENVTOOL) vllm-omni $(VO_VENV)

venv-bench:
	@$(ENVTOOL) bench $(BENCH_VENV)

# A LongLive-2.0-like two-shot video (1,024 tokens per chunk, scene cut pinned) with the int2
# packed cache, compared with the bf16 cache on the same seed; the last lines are the summary.
# float32 compute with bf16 caches: CPUs without bf16 instructions run bf16 matmuls ~10x slower.
run: venv
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
run-sglang: venv-sglang
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/demo/sglang/cpu_stand_ins \
	  $(SGL_BIN)/python demo/sglang/run_int2_vs_off.py --out out/sglang

# causalkv inside vLLM-Omni 0.30.0 on a CPU, through vLLM-Omni's own offline entry point:
# `Omni(model=DIR).generate` on the tiny `causalkv vllm-omni-checkpoint` folder (random weights),
# one Omni instance per setting (off, int4, int2) in one process; its table (cache class, KV bytes
# against vLLM-Omni's dense cache, video PSNR vs off as drift); then realtime sessions on the
# paged AR-diffusion engine (two sessions interleaved, vLLM-Omni's pool against causalkv's int2
# pages: sessions admitted, pool bytes per session, drift), the last lines.
# PYTHONPATH brings the CPU stand-ins (demo/vllm_omni/cpu_stand_ins, docs/vllm_omni.md); never
# on a GPU machine.
run-vllm-omni: venv-vllm-omni
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/demo/vllm_omni/cpu_stand_ins \
	  $(VO_BIN)/python demo/vllm_omni/run_offline.py
	HF_HUB_OFFLINE=1 PYTHONPATH=$(CURDIR)/demo/vllm_omni/cpu_stand_ins \
	  $(VO_BIN)/python demo/vllm_omni/run_paged.py

# everything CI runs (.ci/run): each environment, ruff, the layer check and each suite, with the
# wall time of each phase and each suite's 20 slowest tests (tools/test.sh)
test:
	@PY=$(PY) bash tools/test.sh

# the longer runs `make test` leaves out (tests marked `slow`, tests/README.md): new state-machine
# examples at 10x the count, the full-size soak
test-long: venv venv-sglang
	CAUSALKV_MACHINE_EXAMPLES=5000 CAUSALKV_MACHINE_RANDOM=1 $(BIN)/python -m pytest -q -m slow \
	  tests/test_cache_state_machine.py tests/test_soak.py --durations=20
	CAUSALKV_MACHINE_EXAMPLES=5000 CAUSALKV_MACHINE_RANDOM=1 HF_HUB_OFFLINE=1 \
	  $(SGL_BIN)/python tests/sglang_bridge/run.py -k state_machine --durations=20

# The bridge against the released sglang: our tests, then sglang's own unit tests with the hooks on.
test-sglang: venv-sglang
	HF_HUB_OFFLINE=1 $(SGL_BIN)/python tests/sglang_bridge/run.py -n 2 --dist loadfile --durations=20

# The vLLM-Omni bridge against the released vllm-omni 0.30.0 (tests/vllm_omni_bridge/run.py).
test-vllm-omni: venv-vllm-omni
	HF_HUB_OFFLINE=1 $(VO_BIN)/python tests/vllm_omni_bridge/run.py --durations=20

lint: venv
	$(BIN)/ruff check causalkv tests benchmarks demo tools
	$(BIN)/lint-imports

# the benchmarks with their peer quantizers (.venv-bench: they stay out of the suite's .venv)
bench: venv-bench
	$(BENCH_BIN)/python benchmarks/codec.py
	$(BENCH_BIN)/python benchmarks/cache.py
	$(BENCH_BIN)/python benchmarks/plugins.py
	$(BENCH_BIN)/python benchmarks/generate.py
	# the figures of docs/benchmarks.md (reruns codec.py --only quality and generate.py as JSON)
	$(BENCH_BIN)/python benchmarks/report.py --out docs/figures

# the checkout's environments only: the cached layers stay for the next clone
# (`python3 tools/env.py NAME DIR --print-layer` names each)
clean:
	rm -rf $(VENV) $(SGL_VENV) $(VO_VENV) $(BENCH_VENV) out .pytest_cache
