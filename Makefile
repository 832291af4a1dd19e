# kubeinfer developer commands. `make setup` is idempotent; everything runs from .venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.installed

.PHONY: setup test test-all native-prebuilt e2e test-asan bench bench-gpu test-gpu gpu-check gpu-wheels run proto clean clients-venv images push container-engine

setup: $(STAMP)

# torch is pinned to the CPU wheel: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test,gpu,bench]'
	# the native CPU kernels (seconds; without a C compiler the engine warns and uses torch's)
	-$(PY) -m kubeinfer.engine.platforms.cpu.native.build
	touch $(STAMP)

test: setup
	$(VENV)/bin/pytest -q -m "not slow and not e2e"

test-all: setup clients-venv
	$(VENV)/bin/pytest -q

# Every x86-64 level of the native CPU kernels compiled into the package (platforms/cpu/native/prebuilt/, stamped with
# the sources): a wheel built after this, and the CPU image, carry them, so serving nodes need no C compiler
native-prebuilt: setup
	$(PY) -m kubeinfer.engine.platforms.cpu.native.build --prebuild

# The end-to-end suite (tests/e2e/, docs/deploy.md "End-to-end tests"): builds the images, loads them into the cluster
# of $$KUBECONFIG, installs the chart as the README says and serves tiny models through the gateway; prints a
# transcript of timed steps. On this machine: /work/shared/k8s-node (setup.sh, up.sh, `. env.sh`), whose
# buildah-k8s-node ($$K8S_NODE_ENGINE) builds and loads. Skipped, with the reason, without a cluster.
E2E_ARGS ?=
e2e: setup
	$(VENV)/bin/pytest -m e2e -p no:cacheprovider -rs tests/e2e $(E2E_ARGS)

# The native CPU kernels built with AddressSanitizer (platforms/cpu/native/build.py, KUBEINFER_CPU_NATIVE_SANITIZE; cached apart)
# under the crafted-checkpoint suite and the kernels' own tests: python preloads the ASan runtime; any report fails the
# run (ASan exits non-zero; its reports, one file per process, under ASAN_LOG, printed: pytest's capture would swallow
# a report on stderr). Leaks are not checked (CPython's own would drown the kernels').
ASAN_LOG ?= /tmp/kubeinfer-asan
ASAN_TESTS := tests/engine/test_checkpoint_native_shapes.py tests/engine/test_cpu_native_bounds.py \
              tests/engine/test_cpu_native_kernels.py tests/engine/test_cpu_a16_kernel.py \
              tests/engine/test_q8_0_tiles.py tests/engine/test_w4a8_kernels.py tests/engine/test_cpu_f32_linear.py \
              tests/engine/test_cpu_native_decoder.py tests/engine/test_cpu_native_attention.py \
              tests/engine/test_w4a8_decoder.py
test-asan: setup
	rm -rf $(ASAN_LOG) && mkdir -p $(ASAN_LOG)
	KUBEINFER_CPU_NATIVE_SANITIZE=address LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" \
	ASAN_OPTIONS=detect_leaks=0:log_path=$(ASAN_LOG)/report $(VENV)/bin/pytest -q -p no:cacheprovider $(ASAN_TESTS); \
	status=$$?; if ls $(ASAN_LOG)/report* >/dev/null 2>&1; then cat $(ASAN_LOG)/report*; exit 1; fi; exit $$status

# Client programs that pin their own dependencies (guidellm), in a virtual environment of their own,
# for the client-compatibility tests (tests/engine/test_client_compat.py) and the guidellm benchmark.
CLIENTS_VENV := .venv-clients
clients-venv: $(CLIENTS_VENV)/.installed
$(CLIENTS_VENV)/.installed:
	test -x $(CLIENTS_VENV)/bin/python || $(PYTHON) -m venv $(CLIENTS_VENV)
	$(CLIENTS_VENV)/bin/pip install --quiet torch==2.13.0 guidellm==0.8.1
	touch $@

bench: setup
	$(PY) benchmarks/bench_throughput.py
	$(PY) benchmarks/bench_throughput.py --dtype bfloat16
	$(PY) benchmarks/bench_lora.py
	$(PY) benchmarks/bench_routing.py
	$(PY) benchmarks/bench_decode_roofline.py
	$(PY) benchmarks/bench_prefix_cache.py
	$(PY) benchmarks/bench_serving.py
	$(PY) benchmarks/bench_operator.py --write
	$(PY) benchmarks/bench_scale_from_zero.py
	$(PY) benchmarks/bench_tenants.py
	$(PY) benchmarks/bench_spec_decode.py
	$(PY) benchmarks/bench_window_kv.py
	$(PY) benchmarks/bench_security_limits.py
	$(PY) benchmarks/bench_tensor_parallel.py

# On a GPU machine, whose own python has CUDA torch and no registry access: install kubeinfer into it
# first with `python3 -m pip install --no-deps --no-build-isolation -e .`
GPU_PYTHON ?= python3
BENCH_GPU_ARGS ?=
bench-gpu:
	$(GPU_PYTHON) benchmarks/bench_gpu.py $(BENCH_GPU_ARGS)
	@gpus=$$($(GPU_PYTHON) -c 'import torch; print(torch.cuda.device_count())'); \
	if [ "$$gpus" -ge 2 ]; then $(GPU_PYTHON) benchmarks/bench_tensor_parallel.py --device cuda --tp $$gpus; \
	else echo "bench-gpu: one GPU, tensor parallelism not measured (benchmarks/bench_tensor_parallel.py)"; fi

# The GPU path's tests, compiled kernels and captured graphs included (their CUDA cases skip without a GPU).
GPU_TESTS := tests/engine/test_triton_kernels.py tests/engine/test_triton_fused.py tests/engine/test_cuda_graphs.py \
             tests/engine/test_kv_cache_sizing.py tests/engine/test_engine_deferred_text.py \
             tests/engine/test_sampler.py tests/engine/test_triton_windows.py tests/engine/test_gpt_oss.py \
             tests/engine/test_triton_fp8_matmul.py tests/engine/test_triton_int_matmul.py \
             tests/engine/test_triton_moe_int.py tests/engine/test_fused_moe.py tests/engine/test_fused_moe_w8a8.py \
             tests/engine/test_quantized_fp8_kept.py tests/engine/test_kv_cache_dtype.py
test-gpu:
	$(GPU_PYTHON) -m pytest -q -rs $(GPU_TESTS)

# The whole GPU check in one command (docs/gpu.md): carried wheels and kubeinfer installed, GPU_TESTS in
# parallel (the memory-sizing tests alone), then bench-gpu; logs under $$OUT (default gpu-out/).
# `make gpu-wheels` first, where a registry is reachable: the wheels the GPU image lacks, into .whl/.
gpu-check:
	GPU_PYTHON=$(GPU_PYTHON) bash scripts/gpu-check.sh
gpu-wheels: setup
	bash scripts/gpu-wheels.sh

# Regenerate the gRPC stubs after editing kubeinfer/engine/entrypoints/grpc/proto/engine.proto (a test checks they
# are current).
proto: setup
	$(PY) kubeinfer/engine/entrypoints/grpc/proto/generate.py

# The whole stack locally: demo model (trained on first use, cached in .cache/demo-model), two engine
# replicas with one adapter each, the gateway on http://127.0.0.1:8080. Ctrl-C stops it.
# `make run RUN_ARGS=--prometheus`: a Prometheus beside it on :9091 (needs the prometheus binary).
RUN_ARGS ?=
run: setup
	$(VENV)/bin/kubeinfer local-stack $(RUN_ARGS)

clean:
	rm -rf $(VENV) $(CLIENTS_VENV) .pytest_cache build *.egg-info

# Container images, built from docker/*.Dockerfile with docker or podman (whichever is installed; or
# CONTAINER_ENGINE=docker|podman|buildah, or any command that takes docker's `build -f FILE -t TAG --build-arg K=V
# CONTEXT`, such as the k8s-node kit's buildah-k8s-node, which imports what it builds into its node). Names: $(REGISTRY)/engine:$(TAG) (GPU), $(REGISTRY)/engine:$(TAG)-cpu,
# $(REGISTRY)/gateway:$(TAG), $(REGISTRY)/operator:$(TAG), which the chart pulls with
# `--set imageRegistry=$(REGISTRY) --set imageTag=$(TAG)`. IMAGES picks some, e.g. IMAGES="engine-cpu gateway
# operator" for a cluster without GPUs (the GPU image is several GB).
REGISTRY ?= ghcr.io/kubeinfer
TAG      ?= $(shell sed -n 's/^appVersion: *"*\([^"]*\)"*/\1/p' charts/kubeinfer/Chart.yaml)
ALL_IMAGES := engine-cpu engine-gpu gateway operator
IMAGES   ?= $(ALL_IMAGES)
CONTAINER_ENGINE ?= $(shell command -v docker 2>/dev/null || command -v podman 2>/dev/null)
# The engine images' torch wheel index (--build-arg TORCH_INDEX; each Dockerfile has its default: the CPU or the
# CUDA wheels of download.pytorch.org), e.g. a mirror. Other build arguments: BUILD_ARGS="--build-arg K=V ...".
TORCH_INDEX ?=
BUILD_ARGS  ?=
build_args = $(if $(and $(TORCH_INDEX),$(filter engine-%,$(1))),--build-arg TORCH_INDEX=$(TORCH_INDEX)) $(BUILD_ARGS)
image_name = $(REGISTRY)/$(if $(filter engine-%,$(1)),engine:$(TAG)$(if $(filter engine-cpu,$(1)),-cpu),$(1):$(TAG))

container-engine:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make: neither docker nor podman is installed: install one, or name it with CONTAINER_ENGINE=... (docker, podman, buildah or a docker-style build command)" >&2; exit 1; }
	@test -n "$(TAG)" || { echo "make: TAG is empty (give TAG=...)" >&2; exit 1; }
	@test -z "$(filter-out $(ALL_IMAGES),$(IMAGES))" || { echo "make: unknown image(s) $(filter-out $(ALL_IMAGES),$(IMAGES)); IMAGES takes some of: $(ALL_IMAGES)" >&2; exit 1; }

images: container-engine
	$(foreach image,$(IMAGES),$(CONTAINER_ENGINE) build -f docker/$(image).Dockerfile -t $(call image_name,$(image)) $(strip $(call build_args,$(image))) . &&) true
	@echo "built: $(foreach image,$(IMAGES),$(call image_name,$(image)))"

push: images
	$(foreach image,$(IMAGES),$(CONTAINER_ENGINE) push $(call image_name,$(image)) &&) true
