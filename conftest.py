"""Test-session setup shared by every package: 8 virtual CPU devices before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Metaflow reads its user name when imported, and refuses root.
os.environ.setdefault("METAFLOW_USER", "bdlm-test")

import jax  # noqa: E402  (after the environment above)

# The stages turn on JAX's persistent compilation cache (`Run.enable_compilation_cache`): it pays in
# Metaflow steps, each a new process, and saves little in this one long-lived process, where it stays
# off. (Late in full runs, compiling the 8-device OPD step in this process crashed: once in the
# cache's executable write, and with the cache off in the compile itself. That chain now runs in
# processes of its own, `tests/stages_worker.py`.) Tests that start processes keep the cache.
jax.config.update("jax_enable_compilation_cache", False)
