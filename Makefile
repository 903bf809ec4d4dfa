# Every target bootstraps what it needs: a pinned uv in .tools/ and the workspace venv in .venv/.
PYTHON ?= python3.11
UV_VERSION := 0.13.9
UV := .tools/bin/uv
export UV_PYTHON_DOWNLOADS := never
# Bytecode compiled at install: the suite starts hundreds of Python processes, and an environment
# with PYTHONDONTWRITEBYTECODE set would otherwise compile every module they import, in each one.
export UV_COMPILE_BYTECODE := 1
export UV_LINK_MODE := copy
export UV_NO_CONFIG := 1
RUN := $(UV) run --no-sync
# malloc backs XLA:CPU's per-step buffers with transparent huge pages instead of faulting them in
# 4 KiB at a time (bd_core._host_memory): glibc.malloc.hugetlb=1 joins the environment's other
# tunables, unless the environment sets glibc.malloc.hugetlb itself (=0 turns it off).
export GLIBC_TUNABLES := $(if $(findstring glibc.malloc.hugetlb=,$(GLIBC_TUNABLES)),$(GLIBC_TUNABLES),$(if $(GLIBC_TUNABLES),$(GLIBC_TUNABLES):)glibc.malloc.hugetlb=1)
PKG_FILES := pyproject.toml $(wildcard packages/*/pyproject.toml)

.PHONY: sync test lint run stages bench bench-gpu clean interop plan plan-env docs docs-serve
# `ACCEL=cuda12`, `cuda13` or `tpu` (on any target that syncs: `make stages PRESET=... ACCEL=cuda12`)
# adds JAX's CUDA plugin or libtpu at the pinned jax version to .venv after the sync (docs/install.md);
# a sync without it, after a pyproject change, removes them again.
ACCEL ?=
ACCELS := cuda12 cuda13 tpu
JAX_VERSION := $(shell sed -n 's/.*"jax==\([0-9.]*\)".*/\1/p' packages/core/pyproject.toml)
ifneq ($(filter-out $(ACCELS),$(ACCEL)),)
$(error ACCEL=$(ACCEL): expected one of $(ACCELS) (JAX's CUDA 12 or 13 plugin, or libtpu), or nothing for CPU)
endif
sync: .venv/.synced
ifneq ($(ACCEL),)
	$(UV) pip install --python .venv/bin/python --quiet "jax[$(ACCEL)]==$(JAX_VERSION)"
endif

$(UV):
	$(PYTHON) -m venv .tools
	.tools/bin/pip install --quiet uv==$(UV_VERSION)

.venv/.synced: $(PKG_FILES) | $(UV)
	$(UV) sync --python $(PYTHON) --all-packages --group dev --quiet
	@touch $@

# The pipeline on its default preset, or on `make run PRESET=smoke` (a name in flows/configs/) or
# `PRESET=path/to/preset.toml`; Metaflow's datastore is .metaflow/, everything else runs/ (or the
# preset's [run] output_dir, where the summary printed last is read from).
PRESETS := $(sort $(basename $(notdir $(wildcard flows/configs/*.toml))))
ifneq ($(strip $(PRESET)),)
PRESET_FILE := $(firstword $(filter %.toml,$(wildcard $(PRESET) flows/configs/$(PRESET:.toml=).toml)))
ifneq ($(filter run plan stages,$(MAKECMDGOALS)),)
ifeq ($(PRESET_FILE),)
$(error PRESET=$(PRESET): no such preset; give a name in flows/configs/ ($(PRESETS)) or the path of a .toml file)
endif
endif
CONFIG_ARG := --config config $(PRESET_FILE)
else
PRESET_FILE := flows/configs/default.toml
CONFIG_ARG :=
endif

run: sync
	PYTHONUNBUFFERED=1 $(RUN) python flows/bd_pipeline.py $(strip $(CONFIG_ARG) run) --max-workers 2
	@$(RUN) python -m bd_train.stages summary $(PRESET_FILE)

# The stage chain without Metaflow, on this host: `make stages PRESET=<name> [STAGE=sft|opd|grpo]`.
# The same command on every host of a group (the BDLM_* variables, or a TPU VM's workers, SLURM,
# Kubernetes, Open MPI as JAX detects them) is the whole launch; rerun, it continues.
STAGE ?= grpo
stages: sync
	PYTHONUNBUFFERED=1 $(RUN) python -m bd_train.stages run $(PRESET_FILE) --stage $(STAGE)

# Two pytest workers (pytest-xdist), a test file each at a time so that module fixtures run once:
# most tests spend their time compiling on one thread. The slowest files go first (conftest.py's
# SLOW_FILES, in collection order). TEST_WORKERS=0 runs in this process alone. A worker that
# dies ends the run at once (--max-worker-restart 0): a restarted one once left the run waiting.
TEST_WORKERS ?= 2
test: sync
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" $(RUN) pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart 0 --durations=25

# ruff (style, imports, bugbear) and pyright (types), configured in pyproject.toml.
lint: sync
	$(RUN) ruff check .
	$(RUN) pyright

clean:
	rm -rf .venv .tools .interop .plan

# Ahead-of-time plans for TPU slices (bd_train.plan: every stage compiled for a topology from shapes,
# memory per chip and the compiler's cost) need libtpu's compiler: their own venv .plan/ holds
# jax[tpu] (about 1 GB) beside the workspace packages; .venv never does. No TPU is needed.
plan-env: .plan/.synced
.plan/.synced: $(PKG_FILES) | $(UV)
	test -x .plan/bin/python || $(UV) venv --quiet --python $(PYTHON) .plan
	$(UV) pip install --quiet --python .plan/bin/python -e packages/core -e packages/data -e packages/models \
	  -e "packages/train[tpu]"
	@touch $@

# make plan PRESET=sdar_8b TOPOLOGY=v5p:2x2x4 [PLAN_ARGS="--mesh data=2,fsdp=8 --stage grpo"]
TOPOLOGY ?= v5e:2x4
plan: plan-env
	.plan/bin/python -m bd_train.plan $(PRESET_FILE) --topology $(TOPOLOGY) $(PLAN_ARGS)

# Opt-in: bdlm against transformers itself (logits of the committed fixtures, transformers
# loading bdlm's exports, and chat templates' rendering and ids), in a separate venv with torch (CPU) and transformers; never in .venv.
interop:
	test -x .interop/bin/python || $(PYTHON) -m venv .interop
	.interop/bin/pip install --quiet torch==2.13.0
	.interop/bin/pip install --quiet transformers==5.24.0 -e packages/core -e packages/data -e packages/models
	.interop/bin/python packages/models/tests/fixtures/hf/check_live.py

# Benchmarks print ratios measured in one process and refresh their section of BENCHMARKS.md.
bench: sync plan-env
	@for f in bench/train_step.py bench/sampling.py bench/sft_weighting.py bench/remat.py bench/import_memory.py bench/lora.py \
	  bench/profile_step.py bench/sampler_batch.py bench/noisy_views.py bench/host_memory.py bench/checkpoint_digest.py bench/restore_stress.py bench/async_save.py bench/countdown_data.py bench/logits_head.py bench/trace_replay.py; do \
	  if [ -f $$f ]; then echo "== $$f"; $(RUN) python $$f || exit 1; fi; done
	@echo "== bench/plan_presets.py"; .plan/bin/python bench/plan_presets.py

# On a machine with an NVIDIA GPU: JAX's CUDA plugin at the pinned jax version goes into .venv
# (`ACCEL=cuda13` for CUDA 13; default cuda12), then bench/accelerator.py measures the bfloat16
# 1B-config train step and the Pallas attention kernels against XLA's, and bench/rollouts_on_device.py
# the sampler's tokens/s on SDAR-1.7B's shapes at 64 to 512 rows against the GPU's measured roofline.
bench-gpu:
	$(MAKE) sync ACCEL=$(or $(ACCEL),cuda12)
	$(RUN) python bench/accelerator.py
	$(RUN) python bench/rollouts_on_device.py

# The documentation site (mkdocs-material + mkdocstrings, source in docs/, build-time generators in
# docs_build/), built with --strict: a broken link, a missing page or a reference that does not
# resolve fails it. Pages are files (no directory URLs): site/index.html opens from disk.
docs: sync
	NO_MKDOCS_2_WARNING=1 $(RUN) mkdocs build --strict --site-dir site

docs-serve: sync
	NO_MKDOCS_2_WARNING=1 $(RUN) mkdocs serve
