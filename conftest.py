"""Test-session setup shared by every package: 8 virtual CPU devices before jax is imported."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Metaflow reads its user name when imported, and refuses root.
os.environ.setdefault("METAFLOW_USER", "bdlm-test")
