"""One training stage (SFT) as a Metaflow `@parallel` step over `[mesh] num_nodes` processes.

    python flows/bd_parallel.py --config config flows/configs/scale_multihost.toml run
    python flows/bd_parallel.py --config config flows/configs/scale_multihost.toml run --with kubernetes

Locally, Metaflow starts the extra nodes as processes on this machine; on Kubernetes, one pod per
node. Every node joins one JAX process group and trains the same model over the global mesh.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("METAFLOW_USER", os.environ.get("USER") or "bdlm")
if os.environ["METAFLOW_USER"] == "root":
    os.environ["METAFLOW_USER"] = "bdlm"
os.environ.setdefault("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online")
# Local @parallel starts the extra nodes with `python` from PATH: make that this interpreter.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

from metaflow import Config, FlowSpec, Parameter, current, parallel, step  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bd_pipeline import StageRefused, _stage_call, parse_config  # noqa: E402

DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "configs" / "scale_multihost.toml")


class BDParallel(FlowSpec):
    """SFT of one role on a mesh spanning `num_nodes` Metaflow nodes; node 0's result is kept."""

    config = Config("config", default=DEFAULT_CONFIG, parser=parse_config,
                    help="a TOML preset whose [mesh] table sets the mesh and num_nodes")
    role = Parameter("role", default="student", help="which model to train: teacher or student")

    @step
    def start(self):
        from bd_train.stages import PipelineContext

        if self.role not in ("teacher", "student"):
            raise StageRefused(f"--role: expected teacher or student, got {self.role!r}")
        self.context = PipelineContext.create(self.config, run_id=current.origin_run_id or current.run_id,
                                              flow_name=current.flow_name)
        self.next(self.sft, num_parallel=self.config.mesh.num_nodes)

    @parallel
    @step
    def sft(self):
        from bd_train.distributed import ProcessGroup, initialize, shutdown
        from bd_train.stages import run_sft

        mesh = self.config.mesh
        devices_per_node = mesh.data * mesh.fsdp * mesh.model // mesh.num_nodes
        group = ProcessGroup.from_metaflow(current.parallel, run_id=str(current.run_id))
        group = initialize(group, cpu_devices=devices_per_node, timeout_s=120)
        import jax

        self.node_index, self.devices = group.process_id, (jax.process_count(), jax.device_count())
        self.result = _stage_call(run_sft, self.config, self.context, role=self.role)
        shutdown()
        self.next(self.join)

    @step
    def join(self, inputs):
        nodes = list(inputs)
        self.result = next(node.result for node in nodes if node.node_index == 0)
        self.nodes = len(nodes)
        self.next(self.end)

    @step
    def end(self):
        print(f"sft-{self.result.role} on {self.nodes} node(s): step {self.result.step}, "
              f"eval {self.result.evaluation}, checkpoint {self.result.checkpoint_dir}")


if __name__ == "__main__":
    sys.exit(BDParallel())
