"""A Hugging Face `config.json` as a `ModelConfig`, and back.

Reads both forms released checkpoints carry: transformers 4.x (top-level `rope_theta`,
`rope_scaling`) and 5.x (`rope_parameters`). Architectures: `qwen3` and `sdar` (Qwen3 weights,
per-head q/k RMSNorm), `qwen2` and `Fast_dLLM_Qwen` (q/k/v biases), `llama`. What bdlm cannot
run exactly (sliding windows, o-projection or MLP biases, other RoPE types) is refused by name,
never silently approximated. `hf_config` writes the 4.x form, which both transformers 4.x and 5.x
read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from bd_core import ConfigError

from ._config import ModelConfig, RopeScaling

# model_type -> (the weight layout it shares, the transformers class that loads it)
ARCHITECTURES = {
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "sdar": ("qwen3", "SDARForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "Fast_dLLM_Qwen": ("qwen2", "Fast_dLLM_QwenForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
}
"""The Hugging Face `model_type`s `from_pretrained` reads, each with the family it maps to and the architecture name
`save_pretrained` writes."""
EXPORT_TYPES = ("qwen3", "qwen2", "llama")
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
_HF_ACTIVATION = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}
# Keys a config may carry that say where the block size lives (SDAR: block_size; Fast-dLLM v2: bd_size).
_BLOCK_KEYS = ("block_size", "bd_size")


def hf_block_size(raw: Mapping[str, Any]) -> int | None:
    """The block size a checkpoint's config.json (as a dict) was trained with: SDAR's `block_size`,
    else Fast-dLLM v2's `bd_size`; None for an autoregressive checkpoint, which has neither."""
    return next((raw[key] for key in _BLOCK_KEYS if key in raw), None)


class PretrainedError(ConfigError):
    """A checkpoint folder, config or tensor file that bdlm cannot read as asked."""


def _rope(raw: Mapping[str, Any], where: str) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either config form."""
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and "rope_theta" in params:  # 5.x form
        theta, scaling = params["rope_theta"], params
    else:
        theta, scaling = raw.get("rope_theta", 10000.0), raw.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return float(theta), None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise PretrainedError(f"{where}: RoPE type {rope_type!r} is not supported (bdlm runs 'default' and 'llama3' "
                              f"exactly); use a checkpoint without it or add the scaling to bd_models._layers")
    missing_len = raw.get("max_position_embeddings")
    return float(theta), RopeScaling(
        factor=float(scaling["factor"]), low_freq_factor=float(scaling["low_freq_factor"]),
        high_freq_factor=float(scaling["high_freq_factor"]),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", missing_len)))


def _refuse(raw: Mapping[str, Any], where: str, key: str, fix: str) -> None:
    if raw.get(key):
        raise PretrainedError(f"{where}: {key} = {raw[key]!r} is not supported by bdlm's decoder; {fix}")


def model_config_from_hf(raw: Mapping[str, Any], *, where: str = "config.json", block_size: int | None = None,
                         vocab_size: int | None = None, param_dtype: str = "float32",
                         compute_dtype: str | None = None, **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of a checkpoint's config. The block size comes from the config
    (`block_size`, `bd_size`) unless given; an autoregressive checkpoint needs it given.
    `vocab_size` may grow the vocabulary (an added mask token); `overrides` set run-time fields
    (attention implementation, tiles, remat)."""
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise PretrainedError(f"{where}: model_type {model_type!r} is not supported; bdlm reads "
                              f"{sorted(ARCHITECTURES)} (all Qwen2/Qwen3/Llama weight layouts)")
    layout = ARCHITECTURES[model_type][0]
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        raise PretrainedError(f"{where}: use_sliding_window = true is not supported; set it to false (released "
                              f"Qwen checkpoints train without it)")
    if layout == "llama":
        _refuse(raw, where, "attention_bias", "bdlm has q/k/v biases only for the qwen2 layout")
    _refuse(raw, where, "mlp_bias", "bdlm's MLP has no biases")
    act = raw.get("hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise PretrainedError(f"{where}: hidden_act {act!r} is not supported; bdlm runs {sorted(_ACTIVATIONS)}")
    block = block_size if block_size is not None else hf_block_size(raw)
    if block is None:
        raise PretrainedError(f"{where}: no block size (neither {' nor '.join(_BLOCK_KEYS)}); an autoregressive "
                              f"checkpoint needs one chosen: pass block_size= (e.g. 4, as SDAR uses)")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise PretrainedError(f"{where}: tie_word_embeddings = {tie!r}; expected true or false (JSON booleans)")
    # transformers' Qwen3Config and SDAR's SDARConfig default head_dim to 128, not hidden_size / heads
    # (Qwen2's and Llama's)
    head_dim = raw.get("head_dim") or (128 if model_type in ("qwen3", "sdar") else 0)
    try:
        theta, scaling = _rope(raw, where)
        return ModelConfig(
            vocab_size=int(vocab_size if vocab_size is not None else raw["vocab_size"]),
            d_model=raw["hidden_size"], n_layers=raw["num_hidden_layers"], n_heads=raw["num_attention_heads"],
            n_kv_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]), d_ff=raw["intermediate_size"],
            block_size=int(block), rope_theta=float(theta), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            param_dtype=param_dtype, compute_dtype=compute_dtype or param_dtype,
            tie_embeddings=tie, head_dim=head_dim,
            qk_norm=layout == "qwen3", qkv_bias=layout == "qwen2", rope_scaling=scaling,
            activation=_ACTIVATIONS[act], **overrides)
    except PretrainedError:
        raise
    except KeyError as err:
        raise PretrainedError(f"{where}: required key {err.args[0]!r} is missing; the file is not a complete "
                              f"{model_type} config") from None
    except (TypeError, ValueError, ConfigError) as err:  # a value of the wrong type, or one the decoder refuses
        raise PretrainedError(f"{where}: {err} (a value of this {model_type} config; check the file's numbers: "
                              f"hidden_size, num_attention_heads, rope_theta, rms_norm_eps, rope_scaling, ...)") \
            from None


def hf_config(config: ModelConfig, model_type: str, *, base: Mapping[str, Any] | None = None,
              torch_dtype: str = "float32") -> dict[str, Any]:
    """`config.json` content (4.x form) for `config` as `model_type`. Keys of `base` (the imported
    checkpoint's config) that do not describe the architecture are kept (SDAR's block size and
    mask token id, auto_map, token ids)."""
    if model_type not in ARCHITECTURES:
        raise PretrainedError(f"save_pretrained: model_type {model_type!r} is not one of {sorted(ARCHITECTURES)}")
    layout = ARCHITECTURES[model_type][0]
    want = {"qwen3": (True, False), "qwen2": (False, True), "llama": (False, False)}[layout]
    if (config.qk_norm, config.qkv_bias) != want:
        raise PretrainedError(f"save_pretrained: a model with qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias} "
                              f"is not a {model_type} (which has qk_norm={want[0]}, qkv_bias={want[1]}); export it "
                              f"as {_layout_for(config)}")
    # Run-time choices and the 5.x-only keys never carry over; another model_type drops the
    # source's custom-code map (SDAR's auto_map names modeling files the export does not have).
    dropped = {"rope_parameters", "layer_types", "dtype", "attn_implementation"}
    if base and base.get("model_type") != model_type:
        dropped.add("auto_map")
    out = {k: v for k, v in (base or {}).items() if k not in dropped}
    scaling = config.rope_scaling
    out.update({
        "architectures": [ARCHITECTURES[model_type][1]], "model_type": model_type,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim, "intermediate_size": config.d_ff, "hidden_act": _HF_ACTIVATION[config.activation],
        "rms_norm_eps": config.norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": None if scaling is None else {"rope_type": "llama3", **_scaling_dict(scaling)},
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": torch_dtype,
        "block_size": config.block_size, "use_sliding_window": False,
    })
    for key in _BLOCK_KEYS[1:]:  # the source's own key too (Fast-dLLM v2's code reads bd_size)
        if key in out:
            out[key] = config.block_size
    if layout == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    out.setdefault("max_position_embeddings", 32768)
    return out


def _scaling_dict(scaling: RopeScaling) -> dict[str, Any]:
    return {"factor": scaling.factor, "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}


def _layout_for(config: ModelConfig) -> str:
    if config.qk_norm and not config.qkv_bias:
        return "qwen3"
    if config.qkv_bias and not config.qk_norm:
        return "qwen2"
    return "llama" if not config.qk_norm else "nothing transformers reads (qk_norm and qkv_bias together)"
