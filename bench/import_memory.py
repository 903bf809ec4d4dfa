"""Host memory of `from_pretrained`: peak RSS of a fresh process that imports a Hugging Face
checkpoint, against the model's size, on one device and on an 8-device (fsdp 4 x model 2) mesh.

A Qwen3-layout checkpoint of about 0.7 B parameters (2.8 GB in float32, 3 safetensors shards) is
written once with `save_pretrained` from a random model. Each measurement is its own process:
`overhead = peak RSS - RSS of the same process before importing - model bytes` is what the
import held beyond the parameters themselves (on CPU the "devices" are host memory, so the
parameters count in RSS). Writes `bench/results/import_memory.json` and its section of SCALING.md.

    python bench/import_memory.py [--folder /tmp/bdlm_import_bench] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_results, write_section  # noqa: E402

CONFIG: dict = dict(vocab_size=32000, d_model=2048, n_layers=12, n_heads=16, n_kv_heads=8, d_ff=5632, block_size=4,
                    head_dim=128, qk_norm=True, tie_embeddings=False, rope_theta=1e6)

MEASURE = r"""
import json, sys, time
import jax, numpy as np
from bd_models import from_pretrained, make_mesh

def status(key):  # bytes, from /proc (VmHWM is this process's own peak; ru_maxrss can carry the parent's)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024

jax.devices()
before = status("VmRSS")
mesh = make_mesh(1, 4, 2) if len(jax.devices()) == 8 else None
start = time.perf_counter()
model = from_pretrained(sys.argv[1], mesh=mesh)
jax.block_until_ready(model)
seconds = time.perf_counter() - start
leaves = jax.tree.leaves(model)
print(json.dumps({"before": before, "peak": status("VmHWM"), "after_anon": status("RssAnon"),
                  "after_file": status("RssFile"),
                  "model_bytes": sum(x.nbytes for x in leaves), "largest_leaf": max(x.nbytes for x in leaves),
                  "largest_shard": max(s.data.nbytes for x in leaves for s in x.addressable_shards),
                  "seconds": seconds, "devices": len(jax.devices())}))
"""


def write_checkpoint(folder: Path) -> None:
    import jax

    from bd_models import BlockDiffusionLM, ModelConfig, save_pretrained

    model = BlockDiffusionLM(ModelConfig(**CONFIG), key=jax.random.key(0))
    save_pretrained(model, folder, max_shard_bytes=1 << 30)


def measure(folder: Path, devices: int) -> dict:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(folder)], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default="/tmp/bdlm_import_bench")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoint")
    args = parser.parse_args()
    folder = Path(args.folder)
    if not (folder / "config.json").is_file():
        start = time.perf_counter()
        write_checkpoint(folder)
        print(f"wrote {folder} in {time.perf_counter() - start:.0f} s")
    file_bytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    results = {"file_bytes": file_bytes, "shards": len(list(folder.glob("*.safetensors")))}
    rows = []
    for devices in (1, 8):
        m = measure(folder, devices)
        overhead = m["peak"] - m["before"] - m["model_bytes"]
        results.update({f"d{devices}_{k}": v for k, v in m.items()} | {f"d{devices}_overhead": overhead})
        rows.append(f"| {devices} | {m['model_bytes'] / 1e9:.2f} GB | {m['peak'] / 1e9:.2f} GB | "
                    f"{(m['peak'] - m['before']) / m['model_bytes']:.2f} | {overhead / 1e6:.0f} MB | "
                    f"{m['largest_shard'] / 1e6:.0f} MB | {m['seconds']:.1f} s |")
        print(rows[-1])
    write_results("import_memory", results)
    params = results["d1_model_bytes"] / 4 / 1e9
    write_section("import_memory", f"""
### Measured: host memory of an import

`python bench/import_memory.py`: a Qwen3-layout checkpoint of {params:.2f} B parameters
({file_bytes / 1e9:.2f} GB float32 in {results['shards']} safetensors shards, written by `save_pretrained`),
imported by `from_pretrained` in a fresh process. On CPU the devices are host memory, so the
parameters themselves count in the process's RSS; *overhead* is the peak RSS minus the process's
RSS before the import minus the parameters' bytes, i.e. what the import held besides the model.

| devices | parameters | peak RSS | (peak - before) / parameters | overhead | largest shard | time |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Each device's shard is read from the files as a slice (`get_slice`, the file opened per read so
that no mapping keeps touched pages in the process), one parameter leaf at a time: the overhead
is about twice the largest stacked leaf ({results['d1_largest_leaf'] / 1e6:.0f} MB here: all layers
of one MLP weight), its layer slices and their stack, whatever the model's size beyond that. On an
accelerator host the parameters live in device memory, so a host needs the Python/JAX process
(~{results['d1_before'] / 1e9:.2f} GB here) plus that overhead for its share of each leaf. Estimates
from the same rule: SDAR-8B (36 layers, d 4096, d_ff 12288; 16.4 GB in bf16; largest stacked weight
36 x 4096 x 12288 x 2 B = 3.6 GB) on one 8-GPU host or a v5e-8 slice host: about 7 GB of host RAM
beyond the process; on 2 hosts (fsdp over both) about half that. SDAR-1.7B (28 layers, d 2048,
d_ff 6144; 3.4 GB in bf16; largest stacked weight 0.7 GB): about 1.4 GB.
""", markdown=ROOT / "SCALING.md")
    if not args.keep:
        shutil.rmtree(folder)


if __name__ == "__main__":
    main()
