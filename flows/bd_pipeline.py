"""SFT -> on-policy distillation -> GRPO for block-diffusion LMs, as a Metaflow flow.

    python flows/bd_pipeline.py run                                  # the default preset
    python flows/bd_pipeline.py --config config flows/configs/smoke.toml run
    python flows/bd_pipeline.py resume                               # continue a failed run

Steps are thin: each calls a `bd_train.stages` function and keeps small artifacts (checkpoint
paths, fingerprints, metric histories, eval tables); the work and its checks live in bd_train.
"""

import os
import sys
from pathlib import Path

# Defaults that let `python flows/bd_pipeline.py run` work with no environment set up.
os.environ.setdefault("METAFLOW_USER", os.environ.get("USER") or "bdlm")
if os.environ["METAFLOW_USER"] == "root":
    os.environ["METAFLOW_USER"] = "bdlm"
os.environ.setdefault("WANDB_MODE", "offline" if not os.environ.get("WANDB_API_KEY") else "online")

from metaflow import Config, FlowSpec, card, current, step  # noqa: E402
from metaflow.exception import MetaflowException  # noqa: E402

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


class BDPipeline(FlowSpec):
    """Teacher and student SFT, then the student distilled on-policy from the teacher, then GRPO."""

    config = Config("config", default=DEFAULT_CONFIG, parser=parse_config,
                    help="a TOML preset (flows/configs/); validated before anything runs")

    @step
    def start(self):
        from bd_train.stages import PipelineContext

        self.context = PipelineContext.create(self.config, run_id=current.origin_run_id or current.run_id,
                                              flow_name=current.flow_name)
        print(f"run folder: {self.context.run_dir}")
        self.roles = ["teacher", "student"]
        self.next(self.sft, foreach="roles")

    @card(type="blank", id="sft")
    @step
    def sft(self):
        from bd_cards import stage_card
        from bd_train.stages import run_sft

        self.role = self.input
        self.result = _stage_call(run_sft, self.config, self.context, role=self.role)
        stage_card(current.card["sft"], self.result)
        self.next(self.join)

    @step
    def join(self, inputs):
        from bd_train.stages import check_distillation_pair

        self.context = inputs[0].context
        self.sft_results = {inp.role: inp.result for inp in inputs}
        _stage_call(check_distillation_pair, self.sft_results["teacher"], self.sft_results["student"])
        self.next(self.opd)

    @card(type="blank", id="opd")
    @step
    def opd(self):
        from bd_cards import stage_card
        from bd_train.stages import run_opd

        self.opd_result = _stage_call(run_opd, self.config, self.context,
                                      teacher=self.sft_results["teacher"], student=self.sft_results["student"])
        stage_card(current.card["opd"], self.opd_result)
        self.next(self.grpo)

    @card(type="blank", id="grpo")
    @step
    def grpo(self):
        from bd_cards import stage_card
        from bd_train.stages import run_grpo

        self.grpo_result = _stage_call(run_grpo, self.config, self.context, start=self.opd_result)
        stage_card(current.card["grpo"], self.grpo_result)
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
        }, self.context)
        summary_card(current.card["summary"], self.summary)


if __name__ == "__main__":
    sys.exit(BDPipeline())
