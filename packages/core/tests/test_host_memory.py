"""`reuse_host_memory`: a program with a large temporary page-faults it afresh on every call under
glibc's defaults, and not once the setting is on (each case in a fresh process, since the setting
only reaches threads that have not allocated yet). Each child reports its fewest faults over
several calls: a host that pages out idle memory (e.g. DAMON reclaim in a VM) adds faults to some
calls whatever the allocator does."""

import json
import os
import subprocess
import sys

import pytest

from bd_core._host_memory import ENV_SWITCH

CHILD = """
import json, resource, sys
from bd_core import reuse_host_memory
applied = reuse_host_memory()
import jax, jax.numpy as jnp
x = jnp.ones((4096, 64), jnp.float32)
f = jax.jit(lambda x: (x @ x.T) @ x)  # a 64 MiB temporary: the [4096, 4096] product
jax.block_until_ready(f(x))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": min(faults)}))
"""


def run_child(switch: str) -> dict:
    env = {**os.environ, ENV_SWITCH: switch, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the setting is glibc's")
def test_reused_memory_is_not_faulted_again():
    default, reused = run_child("0"), run_child("1")
    assert not default["applied"] and reused["applied"]
    pages = 64 * 2**20 / os.sysconf("SC_PAGE_SIZE")
    assert default["faults"] > 0.9 * pages, default  # the 64 MiB temporary is mapped afresh each call
    assert reused["faults"] < 0.05 * pages, reused
