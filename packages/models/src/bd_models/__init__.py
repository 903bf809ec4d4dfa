"""bd_models: the Equinox block-diffusion decoder, its attention implementations, sharding,
KV cache, FLOP counts, LoRA adapters (`add_lora`, `merge`, `base_model`), the sampler with its
sampling distribution, trace scoring, and Hugging Face checkpoints in and out (`from_pretrained`,
`save_pretrained`: Qwen3, SDAR, Qwen2, Fast-dLLM v2, Llama). Depends on bd_core only. Shape
letters: see bd_core.
"""

from bd_core import ConfigError as ConfigError

from ._attention import attend as attend
from ._attention import blocked_attention as blocked_attention
from ._attention import dense_attention as dense_attention
from ._attention import sharded_attention as sharded_attention
from ._cache import KVCache as KVCache
from ._config import REMAT_POLICIES as REMAT_POLICIES
from ._config import ModelConfig as ModelConfig
from ._config import RopeScaling as RopeScaling
from ._flops import attention_entries as attention_entries
from ._flops import model_flops as model_flops
from ._hf_config import ARCHITECTURES as ARCHITECTURES
from ._hf_config import PretrainedError as PretrainedError
from ._hf_config import hf_block_size as hf_block_size
from ._hf_config import model_config_from_hf as model_config_from_hf
from ._hf_export import save_pretrained as save_pretrained
from ._hf_io import check_pretrained as check_pretrained
from ._hf_io import checkpoint_digest as checkpoint_digest
from ._hf_io import from_pretrained as from_pretrained
from ._hf_io import read_hf_config as read_hf_config
from ._layers import DecoderLayer as DecoderLayer
from ._layers import apply_rope as apply_rope
from ._layers import rms_norm as rms_norm
from ._layers import rope_angles as rope_angles
from ._logits_chunks import logits_chunk as logits_chunk
from ._logits_chunks import map_logits as map_logits
from ._logits_chunks import sum_logits as sum_logits
from ._lora import TARGETS as TARGETS
from ._lora import LoRAConfig as LoRAConfig
from ._lora import LoRAWeight as LoRAWeight
from ._lora import add_lora as add_lora
from ._lora import base_model as base_model
from ._lora import count_params as count_params
from ._lora import has_adapters as has_adapters
from ._lora import merge as merge
from ._lora import trainable as trainable
from ._lora import trainable_filter as trainable_filter
from ._lora import weights_digest as weights_digest
from ._lora import with_dropout_keys as with_dropout_keys
from ._lowering import lower as lower
from ._lowering import lower_denoising_step as lower_denoising_step
from ._lowering import lower_sample as lower_sample
from ._mask import tile_needed as tile_needed
from ._model import BlockDiffusionLM as BlockDiffusionLM
from ._model import head_logits as head_logits
from ._sampler import RecomputeModel as RecomputeModel
from ._sampler import concat_layouts as concat_layouts
from ._sampler import sample as sample
from ._sampler_config import SamplerConfig as SamplerConfig
from ._sampler_text import completion_ids as completion_ids
from ._sampler_text import decode_completions as decode_completions
from ._sampling_dist import SamplingDistribution as SamplingDistribution
from ._sampling_dist import confidence as confidence
from ._sampling_dist import entropy as entropy
from ._sampling_dist import first_argmax as first_argmax
from ._sampling_dist import sampling_logprobs as sampling_logprobs
from ._sampling_dist import token_logprob as token_logprob
from ._scoring import TokenScores as TokenScores
from ._scoring import schedule_logprob as schedule_logprob
from ._scoring import token_logprobs as token_logprobs
from ._scoring import token_scores as token_scores
from ._sharding import MeshError as MeshError
from ._sharding import batch_sharding as batch_sharding
from ._sharding import check_divisibility as check_divisibility
from ._sharding import init_sharded as init_sharded
from ._sharding import logits_format as logits_format
from ._sharding import logits_sharding as logits_sharding
from ._sharding import make_mesh as make_mesh
from ._sharding import param_partition_specs as param_partition_specs
from ._sharding import shard_batch as shard_batch
from ._sharding import shard_model as shard_model
from ._sharding import to_host as to_host
from ._sharding import zeros_placed_like as zeros_placed_like
from ._unroll import unroll_layers as unroll_layers

__version__ = "0.1.0"
