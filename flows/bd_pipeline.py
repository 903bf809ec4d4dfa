"""SFT -> on-policy distillation -> GRPO for block-diffusion LMs, as a Metaflow flow.

    make run PRESET=smoke                                 # set-up, then the flow on flows/configs/smoke.toml
    .venv/bin/python flows/bd_pipeline.py run            # the default preset
    .venv/bin/python flows/bd_pipeline.py --config config flows/configs/smoke.toml run
    .venv/bin/python flows/bd_pipeline.py resume         # continue a failed run
    .venv/bin/python flows/bd_pipeline.py --config config flows/configs/scale_multihost.toml run --with kubernetes

Every training stage is a `@parallel` step over `[mesh] num_nodes` nodes (one by default): the
nodes join one JAX process group and run the stage over the global mesh; node 0's result is
kept. Locally Metaflow starts the extra nodes as processes; on Kubernetes, one pod per node.
(Schedulers that have no `@parallel`, such as Step Functions, cannot deploy this flow.)

Steps are thin: each calls a `bd_train.stages` function and keeps small artifacts (checkpoint
paths, fingerprints, metric histories, eval tables); the work and its checks live in bd_train.
Every stage's card is one task's: `end` prints the exact `card get <run>/<step>/<task>` of each
(teacher and student SFT are two tasks of the step `sft`, so `card get <run>/sft` picks one).
"""

import contextlib
import os
import sys
from pathlib import Path

# Defaults that let `.venv/bin/python flows/bd_pipeline.py run` work with no environment set up.
os.environ.setdefault("METAFLOW_USER", os.environ.get("USER") or "bdlm")
if os.environ["METAFLOW_USER"] == "root":
    os.environ["METAFLOW_USER"] = "bdlm"
os.environ.setdefault("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online")
# Local @parallel starts the extra nodes with `python` from PATH: make that this interpreter.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])

try:
    # `card` and `parallel` are attached to the package at import time (metaflow's plugins): not seen statically
    from metaflow import Config, FlowSpec, card, current, parallel, step  # pyright: ignore[reportAttributeAccessIssue]
    from metaflow.exception import MetaflowException
except ModuleNotFoundError as err:  # a Python outside the workspace venv, e.g. a bare `python` in a fresh shell
    if err.name != "metaflow":
        raise
    sys.exit(f"bd_pipeline: this Python ({sys.executable}) has no Metaflow. Run the flow in the workspace venv: "
             "`make run PRESET=smoke` (sets it up), or `.venv/bin/python flows/bd_pipeline.py ...` after `make sync`.")

# Every local step runs in a process Metaflow starts from this one: malloc there backs XLA's
# per-step buffers with huge pages instead of faulting them in 4 KiB at a time
# (bd_core._host_memory). A Kubernetes pod needs GLIBC_TUNABLES in its own environment. Processes
# that inherit the tunable (every task and card Metaflow starts) skip bd_core, and so jax, when
# they load the flow: the steps import what they need.
if "glibc.malloc.hugetlb=" not in os.environ.get("GLIBC_TUNABLES", ""):
    from bd_core import with_huge_page_malloc

    with_huge_page_malloc(os.environ)

DEFAULT_CONFIG = str(Path(__file__).resolve().parent / "configs" / "default.toml")


class InvalidConfig(MetaflowException):
    headline = "Invalid bdlm config"


class StageRefused(MetaflowException):
    headline = "bdlm stage refused to start"


def parse_config(text):
    """Validate the preset before anything runs; a mistake is one message naming the key."""
    from bd_train.stages import ConfigError, parse_pipeline_config

    try:
        return parse_pipeline_config(text)
    except ConfigError as err:
        raise InvalidConfig(str(err)) from None


def _stage_call(fn, *args, **kwargs):
    """Run a stage; user mistakes (fingerprints, checkpoints, data) surface as one clear message."""
    from bd_train.stages import StageError

    try:
        return fn(*args, **kwargs)
    except StageError as err:
        raise StageRefused(str(err)) from None


def card_commands(cards):
    """What `end` prints: each card, by stage/role, with the command that saves it as HTML.
    `cards` maps "stage/role" to the pathspec (flow/run/step/task) of the task that holds it."""
    width = max(map(len, cards))
    lines = ["cards (each command saves one as an HTML file):"]
    for label, pathspec in cards.items():
        task = pathspec.split("/", 1)[1]  # `card get` takes run/step/task, the flow being the file
        lines.append(f"  {label:<{width}}  .venv/bin/python flows/bd_pipeline.py card get {task} "
                     f"{label.replace('/', '-')}.html")
    return "\n".join(lines)


@contextlib.contextmanager
def process_group(config):
    """Join this `@parallel` node to the stage's JAX process group (a no-op group for one node),
    with the mesh's share of devices per node as CPU devices when running on CPUs."""
    from bd_nodes import process_group as group_of

    from bd_train.distributed import initialize, shutdown
    from bd_train.stages import pipeline_config

    mesh = pipeline_config(config).mesh
    group = group_of(current.parallel, run_id=str(current.run_id))  # pyright: ignore[reportAttributeAccessIssue]
    initialize(group, cpu_devices=mesh.devices // mesh.num_nodes, timeout_s=300)
    yield group
    # Only after success: a failed node must not wait at the shutdown barrier for nodes that are
    # still inside collectives; its process exits, and the task fails with the original error.
    shutdown()




class BDPipeline(FlowSpec):
    """Teacher and student SFT, then the student distilled on-policy from the teacher, then GRPO."""

    config = Config("config", default=DEFAULT_CONFIG, parser=parse_config,
                    help="a TOML preset (flows/configs/); validated before anything runs")

    def _run_on_nodes(self, stage_fn, card_id, stage, **kwargs):
        """Run a stage on this `@parallel` node inside the stage's process group; fill its card and
        add this task's pathspec to `cards` under "stage/role" (the only unambiguous card id)."""
        from bd_cards import stage_card
        from bd_nodes import fail_after

        with process_group(self.config) as group:
            self.node_index = group.process_id
            result = _stage_call(stage_fn, self.config, self.where, fail_after=fail_after(stage), **kwargs)
        stage_card(current.card[card_id], result)  # pyright: ignore[reportAttributeAccessIssue]
        self.cards = {**self.cards, f"{card_id}/{result.role}": current.pathspec}
        return result

    def _keep_node_zero(self, inputs, *names):
        """In the join after a `@parallel` step: node 0's artifacts `names` (every node holds the
        same result, and `cards` names each node's own task) and the artifacts the nodes share."""
        node_zero = next(node for node in inputs if node.node_index == 0)
        for name in names:
            setattr(self, name, getattr(node_zero, name))
        self.merge_artifacts(inputs, exclude=[*names, "node_index"])

    @step
    def start(self):
        from bd_train.stages import RunDir, check_adopted

        _stage_call(check_adopted, self.config)  # before anything trains
        self.where = RunDir.create(self.config, run_id=str(current.origin_run_id or current.run_id))
        print(f"run folder: {self.where.run_dir}")
        self.roles = ["teacher", "student"]
        self.cards = {}  # "stage/role" -> the pathspec of the task that holds its card
        self.next(self.sft_launch, foreach="roles")

    @step
    def sft_launch(self):
        self.role = self.input
        self.next(self.sft, num_parallel=self.config.mesh.num_nodes)

    @card(type="blank", id="sft")
    @parallel
    @step
    def sft(self):
        from bd_train.stages import run_sft

        self.result = self._run_on_nodes(run_sft, "sft", f"sft-{self.role}", role=self.role)
        self.next(self.sft_nodes)

    @step
    def sft_nodes(self, inputs):
        self._keep_node_zero(inputs, "result", "cards")
        self.next(self.join)

    @step
    def join(self, inputs):
        from bd_train.stages import check_distillation_pair

        self.where = inputs[0].where
        self.sft_results = {inp.role: inp.result for inp in inputs}
        self.cards = {label: task for inp in inputs for label, task in inp.cards.items()}
        _stage_call(check_distillation_pair, self.sft_results["teacher"], self.sft_results["student"])
        self.next(self.opd_launch)

    @step
    def opd_launch(self):
        self.next(self.opd, num_parallel=self.config.mesh.num_nodes)

    @card(type="blank", id="opd")
    @parallel
    @step
    def opd(self):
        from bd_train.stages import run_opd

        self.opd_result = self._run_on_nodes(run_opd, "opd", "opd", teacher=self.sft_results["teacher"],
                                             student=self.sft_results["student"])
        self.next(self.opd_nodes)

    @step
    def opd_nodes(self, inputs):
        self._keep_node_zero(inputs, "opd_result", "cards")
        self.next(self.grpo_launch)

    @step
    def grpo_launch(self):
        self.next(self.grpo, num_parallel=self.config.mesh.num_nodes)

    @card(type="blank", id="grpo")
    @parallel
    @step
    def grpo(self):
        from bd_train.stages import run_grpo

        self.grpo_result = self._run_on_nodes(run_grpo, "grpo", "grpo", start=self.opd_result)
        self.next(self.grpo_nodes)

    @step
    def grpo_nodes(self, inputs):
        self._keep_node_zero(inputs, "grpo_result", "cards")
        self.next(self.end)

    @card(type="blank", id="summary")
    @step
    def end(self):
        from bd_cards import summary_card

        from bd_train.stages import summarize

        self.summary = summarize({
            "teacher_sft": self.sft_results["teacher"],
            "student_sft": self.sft_results["student"],
            "student_opd": self.opd_result,
            "student_grpo": self.grpo_result,
        }, self.where)
        summary_card(current.card["summary"], self.summary)  # pyright: ignore[reportAttributeAccessIssue]
        self.cards = {**self.cards, "summary": current.pathspec}
        print(card_commands(self.cards))


if __name__ == "__main__":
    from bd_resume import rebase_cloned_mapper_tasks  # the flow's folder is on sys.path when run as a script

    rebase_cloned_mapper_tasks()  # before the runtime clones anything (`resume`)
    BDPipeline()
