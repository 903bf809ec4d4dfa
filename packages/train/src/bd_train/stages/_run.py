"""`Run`: one pipeline run's context. Where its files live (`RunDir`), the validated config and
what it builds on its data (`RunData`): model, sampler and optimizer configs, identities, meshes,
and the models a stage starts from.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from bd_core import Fingerprint, FingerprintMismatch, fingerprint
from bd_models import (
    BlockDiffusionLM,
    LoRAConfig,
    MeshError,
    ModelConfig,
    PretrainedError,
    add_lora,
    check_divisibility,
    check_pretrained,
    checkpoint_digest,
    from_pretrained,
    init_sharded,
    make_mesh,
    merge,
    param_partition_specs,
    weights_digest,
)

from .._checkpoint import Checkpointer, CheckpointError
from .._fingerprints import model_identity, rollout_semantics
from .._trainer import TrainState
from ._config import pipeline_config
from ._config_io import to_dict
from ._errors import StageError as StageError
from ._run_configs import RunConfigs
from ._run_data import RunData, stream
from ._stage_sections import SamplerSection

ROLES = ("teacher", "student")
ADAPTER_STREAMS = 100  # a stage's fresh LoRA adapters draw from stream 100 + its index
# How the model is computed, not what it computes (the implementations agree to float tolerance):
# a stage may change these without invalidating the checkpoint it starts from.
EXECUTION_FIELDS = ("attention", "q_tile", "k_tile", "remat", "logits_chunk")


@dataclasses.dataclass(frozen=True)
class RunDir:
    """Where one pipeline run keeps its files; stable across `resume` (keyed by the origin run).
    Small and picklable: the flow keeps it as an artifact."""

    run_id: str
    run_dir: str

    @classmethod
    def create(cls, config: Any, *, run_id: str) -> RunDir:
        """The run's folder `<[run] output_dir>/pipeline/<run_id>`, created if needed."""
        run_dir = Path(pipeline_config(config).run.output_dir).resolve() / "pipeline" / str(run_id)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise StageError(f"run.output_dir: cannot create {str(run_dir)!r} ({err.strerror}); set [run] output_dir "
                             f"to a folder this process can write") from None
        return cls(str(run_id), str(run_dir))

    def checkpoint_dir(self, stage: str) -> Path:
        """Where `stage` keeps its checkpoints."""
        return Path(self.run_dir) / "checkpoints" / stage

    @property
    def outputs(self) -> Path:
        """The output folder shared by runs: W&B logs, the compilation cache, `latest/`."""
        return Path(self.run_dir).parent.parent


class Run(RunData, RunConfigs):
    """A pipeline run as one stage sees it: config, folders, and everything built from the config:
    its data, random streams and rewards (`RunData`), its model, sampler and optimizer configs
    (`RunConfigs`), and its identities, meshes and models. Without `where` it builds the configs
    and models only (nothing is written). `tokenizer` stands in for the configured one (anything with `vocab_size`,
    `mask_id`, `pad_id`, `eos_id`: an ahead-of-time plan of a checkpoint whose tokenizer file is
    not at hand)."""

    def __init__(self, config: Any, where: RunDir | None = None, *, tokenizer: Any = None):
        super().__init__(pipeline_config(config), tokenizer=tokenizer)
        self._where = where
        self._identities: dict[str, Fingerprint] = {}

    @property
    def where(self) -> RunDir:
        if self._where is None:
            raise StageError("this Run was made without a RunDir: pass one to write checkpoints and logs")
        return self._where

    # -- fingerprints --------------------------------------------------------------------------------

    def identity(self, role: str) -> Fingerprint:
        """Model identity: architecture (without how it is computed), tokenizer, special ids, block
        size, canvas and alignment. Computed once per role (a pretrained role reads its files)."""
        if role not in self._identities:
            self._identities[role] = self._identity(role)
        return self._identities[role]

    def _identity(self, role: str) -> Fingerprint:
        tok, canvas = self.tokenizer, self.config.canvas
        architecture = {k: v for k, v in self.model_config(role).to_dict().items() if k not in EXECUTION_FIELDS}
        section = getattr(self.config, role)
        pretrained, source = section.folder, section.source
        extra: dict[str, Any] = {"pad_id": tok.pad_id, "eos_id": tok.eos_id, "prompt_len": canvas.prompt_len,
                 "max_new_tokens": canvas.max_new_tokens}
        if pretrained:  # where the weights started: the checkpoint's config and tensor headers
            extra["pretrained"] = checkpoint_digest(pretrained)
        if source is not None and source.repo_id is not None:  # and which Hub commit they came from
            extra["pretrained_source"] = source.to_dict()
        return model_identity(architecture, tokenizer=tok.identity, vocab_size=tok.vocab_size, mask_id=tok.mask_id,
                              block_size=canvas.block_size, canvas_policy=canvas.policy, alignment="target",
                              extra=extra)

    def training(self, stage: str) -> Fingerprint:
        """What defines a stage's training beyond the model: the task, the seed and the stage's
        whole config section (steps, batch, optimizer and schedule, corruption or objective,
        rollout decoding), the chat template's digest when prompts go through one, and the user's
        JSONL files by their bytes. A stage's checkpoints pin it, so a resume under a changed preset
        or a data file edited in place is refused by field name (`training.sft.optim.lr: saved
        0.003, current 0.001`, `training.chat_template: ...`, `training.data.train_jsonl: ...`)."""
        cfg = self.config
        section = "sft" if stage.startswith("sft-") else stage
        # The chat template counts by its text, wherever it was read from (and, off, leaves the
        # fingerprint as it was before the key existed).
        task = {k: v for k, v in to_dict(cfg.task).items() if k != "chat_template"}
        # OPD's guard decides what is handed on, not what trains: a run stopped by it continues
        # under another mode (and checkpoints from before the key existed still match).
        values = {k: v for k, v in to_dict(getattr(cfg, section)).items() if k != "guard"}
        fields: dict[str, Any] = {"seed": cfg.run.seed, "task": task, section: values}
        if self.chat_template is not None:
            fields["chat_template"] = self.chat_template.digest
        if self.data_digests:
            fields["data"] = self.data_digests
        if section == "sft":
            fields["steps"] = cfg.sft.steps_for(stage.removeprefix("sft-"))
        return fingerprint(to_dict(fields))

    def rollout_semantics(self, section: SamplerSection) -> Fingerprint:
        """What recorded traces mean: GRPO refuses to continue from traces sampled otherwise."""
        return rollout_semantics(self.sampler_config(section), prompt_len=self.config.canvas.prompt_len)

    # -- meshes and models ---------------------------------------------------------------------------

    def mesh(self, *model_configs: ModelConfig, batch_size: int, roles: tuple[str, ...] = ("student",)
             ) -> jax.sharding.Mesh | None:
        """The config's mesh over every process's devices, checked against each model (of `roles`,
        in order, which a refusal names) and the (micro)batch; None on a single device, where
        nothing is placed."""
        section = self.config.mesh
        if section.devices == 1:
            return None
        if section.devices != jax.device_count():
            raise StageError(f"mesh: data*fsdp*model = {section.devices} but this run has {jax.device_count()} "
                             f"devices over {jax.process_count()} process(es); match the mesh to the devices")
        mesh = make_mesh(section.data, section.fsdp, section.model)
        shards = section.data * section.fsdp  # the stage's (micro)batch, then each model's sizes, by role
        if batch_size % shards:
            raise StageError(f"mesh: batch size = {batch_size} does not divide the mesh axes it is sharded over "
                             f"(data*fsdp = {shards}) on the mesh {dict(mesh.shape)}; make it a multiple of {shards} "
                             f"or change the mesh")
        for role, model_config in zip(roles, model_configs, strict=True):
            try:
                check_divisibility(model_config, mesh)
            except MeshError as err:
                raise StageError(f"mesh: the {role}'s {err}") from None
        return mesh

    @staticmethod
    def fresh_state(model_config: ModelConfig, optimizer, *, key: jax.Array,
                    mesh: jax.sharding.Mesh | None = None) -> TrainState:
        """A new model (built straight into its shards on a mesh) in a new train state."""
        model_key, train_key = jax.random.split(key)
        make = lambda: BlockDiffusionLM(model_config, key=model_key)  # noqa: E731
        if mesh is not None:
            return TrainState.init(init_sharded(make, mesh), optimizer, key=train_key)
        return committed(TrainState.init(make(), optimizer, key=train_key))

    def initial_state(self, role: str, model_config: ModelConfig, optimizer, *, key: jax.Array,
                      mesh: jax.sharding.Mesh | None = None, start: tuple[str, str] | None = None) -> TrainState:
        """The state SFT starts from: the model of `start` (a stage's name and checkpoint folder:
        SFT continuing after it, with a fresh optimizer), the pretrained checkpoint's weights (read
        into their shards), or a fresh model."""
        if start is not None:
            model = self.restore_model(start[1], model_config, self.identity(role),
                                       what=f"the {start[0]} checkpoint SFT starts from", mesh=mesh)
        elif not getattr(self.config, role).folder:
            return self.fresh_state(model_config, optimizer, key=key, mesh=mesh)
        else:
            model = self.pretrained_model(role, mesh=mesh)
            if model.config != model_config:
                raise StageError(f"{role}: the model read from {getattr(self.config, role).folder} is not the "
                                 f"configured one ({model.config} vs {model_config})")
        lora = self.lora(role, "sft")
        if lora is not None:  # adapters on the model SFT starts from, which stays frozen
            model = self.adapt(model, lora, f"sft-{role}")
        state = TrainState.init(model, optimizer, key=jax.random.split(key)[1])
        return state if mesh is not None else committed(state)

    # -- LoRA ----------------------------------------------------------------------------------------

    def lora(self, role: str, stage: str) -> LoRAConfig | None:
        """The role's LoRA adapters in `stage` (`sft`, `opd`, `grpo`, `rft`); None: full fine-tuning."""
        section = getattr(self.config, role).lora
        return section.lora_config() if section is not None and stage in section.stages else None

    def adapt(self, base: Any, lora: LoRAConfig, stage: str) -> Any:
        """`base` (the model the stage starts from) with the stage's fresh adapters: `B` is zero, so
        the adapted model starts equal to its base."""
        key = jax.random.fold_in(jax.random.key(self.config.run.seed), ADAPTER_STREAMS + stream(stage))
        return add_lora(base, lora, key=key)

    @staticmethod
    def adapters_pin(model: Any, lora: LoRAConfig | None, source: dict[str, str]) -> dict[str, Fingerprint]:
        """What a LoRA stage's checkpoints pin beyond the identity: the adapter config, where the
        base comes from (`{"pretrained": role}` or `{"checkpoint": folder}`) and a digest of the
        base weights, so that adapters are never resumed or read on another base. Empty for full
        fine-tuning."""
        if lora is None:
            return {}
        digest = adapted_checkpoint_digest(source["checkpoint"]) if "checkpoint" in source else None
        return {"adapters": fingerprint({"lora": lora.to_dict(), "base_source": source,
                                         "base_digest": digest or weights_digest(model)})}

    def _reading(self, role: str) -> dict[str, Any]:
        """`from_pretrained`'s arguments for the role's checkpoint as configured: the canvas's block
        size, the tokenizer's vocabulary (an added mask token's row is the mean of the tokens'
        rows), the section's dtypes."""
        folder = getattr(self.config, role).folder
        if not folder:
            raise StageError(f"{role}: no pretrained checkpoint is configured ([{role}] pretrained)")
        kwargs = {k: v for k, v in self._pretrained_kwargs(role).items() if k not in ("raw", "where")}
        added = getattr(self.tokenizer, "added_mask", False)
        return dict(path=folder, new_rows_from=self.tokenizer.mask_id if added else None, **kwargs)

    def pretrained_model(self, role: str, *, mesh: jax.sharding.Mesh | None = None) -> BlockDiffusionLM:
        """The role's pretrained checkpoint as configured (`_reading`)."""
        return from_pretrained(**self._reading(role), mesh=mesh)

    def check_pretrained(self, role: str) -> None:
        """Read the role's pretrained checkpoint as `pretrained_model` would, but not its weights:
        every shard present and readable, every tensor there with its shape. Refused naming the key."""
        try:
            check_pretrained(**self._reading(role))
        except PretrainedError as err:
            raise StageError(f"{role}.pretrained: {err}") from None

    def export(self, model: BlockDiffusionLM, stage: str, role: str) -> Path:
        """`model` (adapters merged) as a Hugging Face checkpoint in `<run>/export/<stage>`
        (`export_model`)."""
        from ._export import export_model

        return export_model(self, model, stage, role)

    def restore_model(self, directory: str | Path, model_config: ModelConfig, identity: Fingerprint, *, what: str,
                      mesh: jax.sharding.Mesh | None = None) -> Any:
        """The model saved in `directory` (its latest step), after checking its identity fingerprint
        and leaves against `model_config`; any mismatch refuses with every differing field named.
        With a mesh, it is restored straight into its shards.

        A LoRA stage's checkpoint holds adapters only: its base is rebuilt first (the pretrained
        checkpoint, or the earlier stage's checkpoint, recursively), must match the weights digest
        the checkpoint pinned, and the adapters are then read onto it and merged."""
        checkpoints = open_checkpoints(directory, create=False)
        try:
            saved = checkpoints.fingerprints()
            if "adapters" in saved:
                target = self._adapted_target(saved["adapters"], model_config, identity, what=what, mesh=mesh)
                model = merge(checkpoints.restore_model(target, fingerprints={"identity": identity}))
                return model if mesh is not None else committed(model)
            target = eqx.filter_eval_shape(BlockDiffusionLM, model_config, key=jax.random.key(0))
            if mesh is not None:
                specs = param_partition_specs(target, mesh)
                target = jax.tree.map(lambda x, spec: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec)), target, specs)
            return checkpoints.restore_model(target, fingerprints={"identity": identity})
        except (FingerprintMismatch, CheckpointError) as err:
            raise StageError(f"{what}: {err}") from None
        finally:
            checkpoints.close()

    def _adapted_target(self, pinned: Fingerprint, model_config: ModelConfig, identity: Fingerprint, *, what: str,
                        mesh: jax.sharding.Mesh | None) -> Any:
        """The base a LoRA checkpoint was trained on, checked against its pinned digest, with
        adapters of the pinned shape (their values are then read from the checkpoint)."""
        source = pinned.fields["base_source"]
        if "pretrained" in source:
            base = self.pretrained_model(source["pretrained"], mesh=mesh)
        else:
            base = self.restore_model(source["checkpoint"], model_config, identity, mesh=mesh,
                                      what=f"{what}: its base {source['checkpoint']}")
        pinned_digest = str(pinned.fields["base_digest"])
        by_content = "checkpoint" in source and pinned_digest.startswith("saved:")  # else as bdlm pinned it before
        digest = adapted_checkpoint_digest(source["checkpoint"]) if by_content else None
        digest = digest or weights_digest(base)
        if digest != pinned_digest:
            raise StageError(f"{what}: its LoRA adapters were trained on a base ({source}) whose weights digest "
                             f"was {pinned.fields['base_digest'][:12]}, but that base now reads {digest[:12]}: "
                             f"adapters.base_digest differs. Restore the base it was trained on, or rerun the stage")
        return add_lora(base, LoRAConfig.from_dict(pinned.fields["lora"]), key=jax.random.key(0))


def adapted_checkpoint_digest(directory: str | Path) -> str | None:
    """For a LoRA stage's checkpoint (adapters on a base it pins), a digest of what it holds: the
    content digests its latest step recorded for the adapters, and its own base's pin, so a chain
    of LoRA stages is pinned link by link by content. Merged, its model's bits depend on the
    mesh and backend that merged it, so they cannot pin it. None for any other checkpoint (its
    restored weights are the same bits on any layout: `weights_digest` pins them)."""
    checkpoints = open_checkpoints(directory, create=False)
    try:
        meta = checkpoints.read_meta()
    except CheckpointError as err:
        raise StageError(str(err)) from None
    finally:
        checkpoints.close()
    adapters = (meta.get("fingerprints") or {}).get("adapters")
    if adapters is None:
        return None
    model = {path: shards for path, shards in sorted((meta.get("digests") or {}).items()) if path.startswith("model/")}
    record = {"step": int(meta["step"]), "model": model, "adapters": adapters}
    return "saved:" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def open_checkpoints(directory: str | Path, *, create: bool, max_to_keep: int | None = 2,
                     async_save: bool = False) -> Checkpointer:
    """A stage's checkpoint folder; without `create` one that must hold a stage's checkpoints, refused
    in the preset's terms (a missing folder, one step's folder given for the stage's)."""
    folder = Path(directory)
    if not create and not folder.is_dir():
        raise StageError(f"checkpoint folder {str(folder)!r} does not exist; give a stage's checkpoint folder "
                         f"(<output_dir>/pipeline/<run-id>/checkpoints/<stage>)")
    if not create and folder.name.isdigit() and (folder / "meta").is_dir():
        raise StageError(f"{str(folder)!r} is one step of the checkpoint folder {str(folder.parent)!r}; give that "
                         f"folder (its latest complete step is used)")
    try:
        return Checkpointer(directory, max_to_keep=max_to_keep, create=create, async_save=async_save)
    except CheckpointError as err:
        raise StageError(str(err)) from None


def committed(tree: Any) -> Any:
    """`tree`'s arrays committed to the default device, as a restored checkpoint's are. A program
    compiled for committed arguments differs from one for uncommitted arguments (it carries their
    shardings), so a stage that starts from fresh or imported weights would otherwise compile its
    sampler and evaluation anew for the next stage, which starts from the saved checkpoint (and
    miss JAX's persistent compilation cache)."""
    device = jax.local_devices()[0]
    return jax.tree.map(lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) else x, tree)
