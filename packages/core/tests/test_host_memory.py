"""`with_huge_page_malloc`: the tunable it adds reaches a child process, keeps the environment's
other tunables and an explicit choice; and in that child a program with a large temporary takes
far fewer page faults per call than under glibc's defaults (each case in a fresh process, since
glibc reads tunables at start). Each child reports its fewest faults over several calls: a host
that reclaims idle memory (e.g. DAMON in a VM) adds faults to some calls whatever malloc does."""

import json
import os
import subprocess
import sys

import pytest

from bd_core import tunable_takes_effect, with_huge_page_malloc

CHILD = """
import json, resource
import jax, jax.numpy as jnp
from bd_core import huge_page_malloc_active
x = jnp.ones((4096, 64), jnp.float32)
f = jax.jit(lambda x: (x @ x.T) @ x)  # a 64 MiB temporary: the [4096, 4096] product
jax.block_until_ready(f(x))
faults = []
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    jax.block_until_ready(f(x))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"active": huge_page_malloc_active(), "faults": min(faults)}))
"""


def test_tunable_is_added_once_and_keeps_other_and_explicit_settings():
    env: dict[str, str] = {}
    with_huge_page_malloc(env)
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    with_huge_page_malloc(env)
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    other = {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}
    with_huge_page_malloc(other)
    assert other["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:glibc.malloc.hugetlb=1"
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    with_huge_page_malloc(off)
    assert off["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def run_child(huge: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"} | {"JAX_PLATFORMS": "cpu"}
    if huge:
        with_huge_page_malloc(env)
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not tunable_takes_effect(), reason="the tunable changes nothing here: not glibc >= 2.35, "
                    "or the THP mode is not `madvise` (`always` gives huge pages anyway, `never` none)")
def test_huge_pages_spare_the_faults_of_a_large_temporary():
    default, huge = run_child(False), run_child(True)
    assert not default["active"] and huge["active"]
    pages = 64 * 2**20 / os.sysconf("SC_PAGE_SIZE")
    assert default["faults"] > 0.9 * pages, default  # the 64 MiB temporary is faulted in afresh each call
    assert huge["faults"] < 0.05 * pages, huge
