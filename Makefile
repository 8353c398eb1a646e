# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Both create .venv on first use: $(PYTHON), torch from $(TORCH_SPEC), the newest triton,
# pytest and the optional packages. torch==2.13.0 is a CPU build only where a local wheel of
# it exists (this project's machines); from PyPI elsewhere it is the multi-GB CUDA build.
# Choose another torch without editing anything:
#   make test TORCH_SPEC='torch==2.5.1' PIP_INDEX_URL=https://download.pytorch.org/whl/cpu
#   make test VENV_FLAGS=--system-site-packages TORCH_SPEC=     # reuse the torch you have
# `make test-min` (CI runs it after `make test`) tests the oldest declared versions, and
# `make test-newest` the newest torch the registry serves with the Triton it pins.
PYTHON     ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV_FLAGS ?=
PY         := .venv/bin/python
PIP        := .venv/bin/pip
STAMP      := .venv/.installed
SOURCES    := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h)
# pytest 9.2 keeps a node's id where pytest-xdist 3.8's loadgroup no longer renames it: every
# xdist_group mark is ignored (module fixtures built on both workers, the Ray and sandbox
# tests side by side). Python 3.9 gets pytest 8.4, which the cap does not touch.
PYTEST_PKGS := "pytest<9.2" pytest-xdist
EXTRAS     := "triton>=3.4" $(PYTEST_PKGS) numpy zstandard safetensors matplotlib tqdm
# The trainers the integration tests run against (pyproject's [integrations]; verl without
# its full dependency set, which the loss path does not import) and Ray for the example.
TRAINERS   := "trl==1.16.0" "transformers==5.10.4" "ray==2.60.0" "tensordict==0.10.0" \
              omegaconf codetiming

# A first-found interpreter of one minor version (a pyenv-style install counts), else python3.
find_python = $(or $(shell for c in python$(1) $$HOME/.pyenv/versions/$(1).*/bin/python$(1) \
  /usr/local/bin/python$(1) /usr/bin/python$(1); do "$$c" -c 'import sys; \
  assert sys.version_info[:2] == tuple(map(int, "$(1)".split(".")))' >/dev/null 2>&1 && \
  { echo "$$c"; break; }; done),python3)

# The torch floor: the oldest Python and torch that pyproject declares (torch 2.4.1 brings the
# triton 3.0.0 it pins, older than the kernels' floor: its kernel tests skip with that reason).
MIN_PYTHON ?= $(call find_python,3.9)
MIN_SPEC   ?= torch==2.4.1
# The kernels' floor: triton 3.4.0 with the torch that pins it (torch 2.8.0).
# numpy<2.3: triton < 3.7's interpreter converts 1-element arrays with int() (fixed in 3.7).
FLOOR_PYTHON ?= $(call find_python,3.12)
FLOOR_SPEC   ?= torch==2.8.0 triton==3.4.0 "numpy<2.3"
# The lent GPU image's stack: triton 3.6.0 with torch 2.11.0 on Python 3.12.
COMPAT_PYTHON ?= $(call find_python,3.12)
COMPAT_SPEC   ?= torch==2.11.0 triton==3.6.0 "numpy<2.3"
# The packages the GPU image lacks come from gpu_wheels.sh, installed as a device run does.
COMPAT_PATH   := $(CURDIR)/.venv-compat/gpu-site:$(CURDIR)
# The newest torch on the registry, with the Triton it pins (a multi-GB CUDA build).
NEWEST_PYTHON ?= $(call find_python,3.11)
NEWEST_SPEC   ?= torch==2.15.0
# This project's machines cap torch at 2.14.1 with a constraint file named in /etc/xdg/pip's
# config; that stage's torch install replaces it with an empty one (the rest of the config
# stands; elsewhere nothing changes).
NEWEST_PIP_ENV := $(if $(wildcard /etc/xdg/pip/constraints.txt),PIP_CONSTRAINT=/dev/null)
# The kernel tests each Triton stage runs in the interpreter.
KERNEL_TESTS := tests/loss tests/muon tests/topk tests/delta tests/test_dispatch.py
# Every pytest run is parallel (pytest-xdist): one worker per core, at most 4 (each holds
# torch, the trainers and a Ray driver; most of a worker's time is the Triton interpreter
# and Inductor's compiles). Tests are handed out one at a time except those marked
# xdist_group, which run in one worker, in order: a module's shared fixtures (built once), and
# the modules that run Ray in-process (one local Ray instance at a time, as in a serial run).
# JOBS=0 runs serially.
JOBS   ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n > 4 ? 4 : n )))
XDIST  := $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS) --dist loadgroup)
# $(call pytest,<python>,<arguments>): pytest's exit 5 (nothing collected) is not a failure.
pytest = $(1) -m pytest -q $(XDIST) $(2); rc=$$?; if [ $$rc -ne 0 ] && [ $$rc -ne 5 ]; then \
  exit $$rc; fi
# $(call timed,<target>): make <target> (its venv set-up included), then say how long it took.
timed = start=$$(date +%s); $(MAKE) --no-print-directory $(1) && \
  echo "ci:   make $(1) took $$(( $$(date +%s) - start )) s"
# What an older (or newer) torch or Triton can break is an op, a kernel or one of their
# options, not the product of the options, which is this project's logic: the version stages
# run each parametrized test with every value of each parameter at least once, the kernels'
# cases first (tests/conftest.py's --each-value-once); `make test` runs every case.
COVER := --each-value-once

.PHONY: demo test test-min test-newest test-megatron check-extras check-verl-install aot bench \
  test-suite aot-check test-torch-floor test-kernels-floor test-gpu-image test-torch-newest \
  version-venvs \
  test-transformers-floor test-transformers-newest \
  venv clean

# pip may resolve other packages against the torch already installed, never replace it.
# The project's own install compiles csrc/ in ./build: one venv at a time (make -j builds
# several venvs side by side, two of them on the same Python).
define install_project
	$(1)/bin/pip install -q --upgrade pip setuptools wheel pybind11
	$(1)/bin/python -c "import torch; print('torch==' + torch.__version__)" > $(1)/torch-pin.txt
	$(1)/bin/pip install -q -c $(1)/torch-pin.txt $(2)
	mkdir -p build
	flock build/.project-install.lock $(1)/bin/pip install -q --no-build-isolation --no-deps -e .
endef

$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) .venv
	$(PIP) install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PIP) install -q "$(TORCH_SPEC)"; fi
	$(call install_project,.venv,$(EXTRAS) $(TRAINERS))
	$(PIP) install -q --no-deps "verl==0.9.1"
	touch $(STAMP)

venv: $(STAMP)

# Main job: the example async GRPO + IcePop trainer on CPU (runs/demo: metrics, plot, checkpoint).
demo: $(STAMP)
	$(PY) -m examples.async_trainer --out-dir runs/demo

# The whole test suite, every case (kernels under Triton's interpreter), then the sm_90
# ahead-of-time compile check. pytest's exit 5 (nothing collected) is not a failure.
test: $(STAMP)
	@$(call timed,test-suite)
	@$(call timed,aot-check)

test-suite: $(STAMP)
	$(call pytest,$(PY),tests)

aot-check: $(STAMP)
	$(PY) benchmarks/aot_report.py --check

# docs/verl.md's install lines in a clean venv (torch from TORCH_SPEC, then exactly those
# lines), then verl's integration tests there (a CI stage of its own, after test-megatron).
check-verl-install: build/verl-venv/.installed
	$(PYTHON) .ci/check_verl_install.py --test "$(or $(TORCH_SPEC),torch)" build/verl-venv

build/verl-venv/.installed: docs/verl.md glm_kernels/integrations/verl/losses.py
	$(PYTHON) .ci/check_verl_install.py --install "$(or $(TORCH_SPEC),torch)" build/verl-venv
	touch $@

.venv-min/.installed: $(SOURCES)
	test -x .venv-min/bin/python || $(MIN_PYTHON) -m venv .venv-min
	.venv-min/bin/pip install -q --upgrade pip
	.venv-min/bin/pip install -q $(MIN_SPEC)
	$(call install_project,.venv-min,$(PYTEST_PKGS) numpy zstandard safetensors matplotlib tqdm)
	touch $@

.venv-floor/.installed: $(SOURCES)
	test -x .venv-floor/bin/python || $(FLOOR_PYTHON) -m venv .venv-floor
	.venv-floor/bin/pip install -q --upgrade pip
	.venv-floor/bin/pip install -q $(FLOOR_SPEC)
	$(call install_project,.venv-floor,$(PYTEST_PKGS) safetensors zstandard)
	touch $@

.venv-newest/.installed: $(SOURCES)
	test -x .venv-newest/bin/python || $(NEWEST_PYTHON) -m venv .venv-newest
	.venv-newest/bin/pip install -q --upgrade pip
	$(NEWEST_PIP_ENV) .venv-newest/bin/pip install -q $(NEWEST_SPEC)
	$(call install_project,.venv-newest,$(PYTEST_PKGS) numpy zstandard safetensors)
	touch $@

.venv-compat/.installed: $(SOURCES)
	test -x .venv-compat/bin/python || $(COMPAT_PYTHON) -m venv .venv-compat
	.venv-compat/bin/pip install -q --upgrade pip
	.venv-compat/bin/pip install -q $(COMPAT_SPEC)
	$(call install_project,.venv-compat,pytest safetensors matplotlib tqdm)
	touch $@

# The tests the torch floor (Python 3.9, torch 2.4.1, triton 3.0: every kernel test skips,
# naming why) runs: what torch 2.4 or Python 3.9 can break. torch.library custom ops (schema
# inference, fake and autograd registration, opcheck: test_custom_op_modules, the ops' tests),
# Dynamo / Inductor (test_compile_inductor, the compile tests), the torch references' numerics
# (tests/loss, muon, topk, delta on the torch backend), torch.distributed / DTensor / FSDP2 /
# gloo (muon sharded, vocab-parallel, sync), torch.multiprocessing shared memory (sync IPC), the
# integrations' imports and plug-ins (their trainers need Python >= 3.10: those tests skip),
# the sdist / wheel built on Python 3.9, and every module imported on Python 3.9. Left to
# `make test`: the example trainer's own logic (routing, trajectories, placement, the sandbox,
# signals and recovery, staleness; Ray needs Python >= 3.10) and the test harness's tests,
# which no torch or Python version changes; the example still runs end to end on the floor
# (process backend), and bitwise on-policy (the batch-invariant mode rests on torch's kernels).
# (Two pytest runs: given a folder and node ids under an --ignore'd one, pytest 9 drops the
# node ids and pytest 8.4, the one Python 3.9 gets, drops the folder.)
MIN_TESTS := tests --ignore=tests/examples --ignore=tests/test_testing.py

# The oldest declared versions: MIN_TESTS beside the torch floor; the extras resolved beside the floor torches without moving them;
# on the kernels' floor (triton 3.4) the interpreter on every kernel test and the sm_90
# compile check (no spills: the kernel modules pick 3.4's launch parameters); on the GPU
# image's stack (triton 3.6) the sm_90 compile check and a CPU dry run of the GPU check with
# the image's wheel set.
test-min:
	@$(call timed,test-torch-floor)
	@$(call timed,check-extras)
	@$(call timed,test-transformers-floor)
	@$(call timed,test-kernels-floor)
	@$(call timed,test-gpu-image)

test-torch-floor: .venv-min/.installed
	@.venv-min/bin/python -c "import sys, torch, triton; print('== torch floor: Python', \
	  sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
	$(call pytest,.venv-min/bin/python,$(COVER) $(MIN_TESTS))

test-kernels-floor: .venv-floor/.installed
	@.venv-floor/bin/python -c "import sys, torch, triton, numpy; print('== kernels floor:', \
	  'Python', sys.version.split()[0], 'torch', torch.__version__, 'triton', \
	  triton.__version__, 'numpy', numpy.__version__)"
	$(call pytest,.venv-floor/bin/python,$(COVER) -m "not slow" $(KERNEL_TESTS))
	.venv-floor/bin/python benchmarks/aot_report.py --check

test-gpu-image: .venv-compat/.installed
	bash benchmarks/gpu_wheels.sh
	rm -rf .venv-compat/gpu-site .venv-compat/gpu-check
	.venv-compat/bin/python -m pip install -q --no-index --no-deps --no-compile \
	  --target .venv-compat/gpu-site .whl/*.whl
	@.venv-compat/bin/python -c "import sys, torch, triton, numpy; print('== GPU image:', \
	  'Python', sys.version.split()[0], 'torch', torch.__version__, 'triton', \
	  triton.__version__, 'numpy', numpy.__version__)"
	.venv-compat/bin/python benchmarks/aot_report.py --check
	PYTHONPATH=$(COMPAT_PATH) .venv-compat/bin/python benchmarks/gpu_check.py --dry-run \
	  --out .venv-compat/gpu-check

# The transformers integration on the oldest transformers it supports (5.2, the first with
# GLM-5) and on the newest (whose MoE routers and DSA indexers have another layout), beside the
# rest of .venv (the integrations' pins): only transformers (and, for the newest, the hub and
# tokenizers releases it requires) differ, put first on the path.
TF_FLOOR       ?= transformers==5.2.0
TF_NEWEST      ?= transformers==5.25.0
TF_TESTS       := tests/integrations/test_transformers.py \
  tests/integrations/test_transformers_r3.py tests/integrations/test_transformers_muon.py \
  tests/invariant/test_models.py
build/tf-floor/.installed: $(STAMP)
	rm -rf build/tf-floor
	$(PIP) install -q --no-deps --target build/tf-floor "$(TF_FLOOR)"
	touch $@

build/tf-newest/.installed: $(STAMP)
	rm -rf build/tf-newest
	$(PIP) install -q --target build/tf-newest "$(TF_NEWEST)"
	touch $@

# $(call tf_tests,<target dir>): the transformers tests with that transformers first on the path
tf_tests = PYTHONPATH=$(1):$(CURDIR) $(PY) -c "import transformers; \
  print('== transformers', transformers.__version__, 'from $(1)')"; \
  $(call pytest,PYTHONPATH=$(1):$(CURDIR) $(PY),$(COVER) $(TF_TESTS))

# The example's policy is transformers' GLM-5 (Python >= 3.10): a short run of each backend and
# its Hugging Face checkpoint on the oldest transformers it supports.
TF_FLOOR_EXAMPLE_TESTS := \
  tests/examples/test_trainer_async.py::test_short_run_learns_and_accounts_for_every_sample \
  tests/examples/test_trainer_invariant.py::test_short_run_is_bitwise_on_policy_process_backend \
  tests/examples/test_hf_checkpoint.py
test-transformers-floor: build/tf-floor/.installed
	@$(call tf_tests,build/tf-floor)
	$(call pytest,PYTHONPATH=build/tf-floor:$(CURDIR) $(PY),$(TF_FLOOR_EXAMPLE_TESTS))

test-transformers-newest: build/tf-newest/.installed
	@$(call tf_tests,build/tf-newest)

# pip's resolution of every extra beside the torch floor and the kernels' floor: nothing in
# them may replace the torch (or its pinned triton) already installed.
check-extras: .venv-min/.installed .venv-floor/.installed
	.venv-min/bin/python .ci/check_extras.py delta example dev
	.venv-floor/bin/python .ci/check_extras.py delta example dev integrations

# The newest torch with its pinned Triton (the same Triton as `make test`, so the interpreter
# runs one test module per package, not the whole kernel suite again): every public op under
# Inductor, the custom-op registrations (opcheck), dispatch, one kernel module per feature.
# The trainers' integration tests need the torch their pinned releases support.
NEWEST_TESTS := tests/test_compile_inductor.py tests/test_dispatch.py tests/loss/test_icepop.py \
  tests/loss/test_logits_logprobs.py tests/loss/test_batch_invariant.py \
  tests/muon/test_newton_schulz.py tests/topk/test_topk.py tests/delta/test_delta_codec.py
test-newest:
	@$(call timed,test-torch-newest)
	@$(call timed,test-transformers-newest)

test-torch-newest: .venv-newest/.installed
	@.venv-newest/bin/python -c "import sys, torch, triton, numpy; print('== newest:', \
	  'Python', sys.version.split()[0], 'torch', torch.__version__, 'triton', \
	  triton.__version__, 'numpy', numpy.__version__)"
	$(call pytest,.venv-newest/bin/python,$(COVER) -m "not slow" $(NEWEST_TESTS))

aot: $(STAMP)
	$(PY) benchmarks/aot_report.py

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf .venv .venv-min .venv-floor .venv-compat .venv-newest .venv-megatron build *.egg-info

# Every venv the later stages use (and the transformers releases the version stages put first
# on the path), built side by side: CI's first stage is `make -j4 venv version-venvs`. Installing a
# CUDA torch is mostly one core decompressing, and five of them one after the other left the
# second core idle for ~10 minutes of CI.
version-venvs: .venv-min/.installed .venv-floor/.installed .venv-compat/.installed \
  .venv-newest/.installed .venv-megatron/.installed build/tf-floor/.installed \
  build/tf-newest/.installed build/verl-venv/.installed

# MuonSplit inside Megatron-core (tests/integrations/test_megatron*.py): megatron-core 0.19
# needs Python >= 3.12, so its own venv with the torch .venv-compat pins (the same wheel) and
# Megatron's Muon dependency, emerging-optimizers. The tests import glm_kernels from the checkout.
MEGATRON_PYTHON ?= $(call find_python,3.12)
MEGATRON_SPEC   ?= torch==2.11.0 megatron-core==0.19.2 emerging-optimizers==0.3.0 pytest

.venv-megatron/.installed: $(SOURCES)
	test -x .venv-megatron/bin/python || $(MEGATRON_PYTHON) -m venv .venv-megatron
	.venv-megatron/bin/pip install -q --upgrade pip
	.venv-megatron/bin/pip install -q $(MEGATRON_SPEC)
	touch $@

test-megatron: .venv-megatron/.installed
	.venv-megatron/bin/python -m pytest -q tests/integrations/test_megatron.py \
	  tests/integrations/test_megatron_parallel.py
