"""Sizes that do not divide their mesh axes fail with the sizes named, before anything compiles."""

import jax
import pytest

import bd_core
import bd_models
from bd_models import BlockDiffusionLM, MeshError, ModelConfig, check_divisibility, make_mesh, shard_batch, shard_model

CONFIG = ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, block_size=4)


def _no_compiles(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the divisibility check")

    monkeypatch.setattr(jax.stages.Lowered, "compile", refuse)


def test_batch_of_6_on_a_data_axis_of_4(monkeypatch, layouts):
    _no_compiles(monkeypatch)
    mesh = make_mesh(4, 1, 2)
    with pytest.raises(MeshError, match=r"batch size = 6 does not divide .*data\*fsdp = 4"):
        check_divisibility(CONFIG, mesh, batch_size=6)
    with pytest.raises(MeshError, match=r"batch size 6 does not divide .*data\*fsdp = 4"):
        shard_batch(layouts(0, batch=6).layout, mesh)


def test_the_batch_counts_every_data_parallel_axis():
    with pytest.raises(MeshError, match=r"batch size = 6 .*data\*fsdp = 4"):
        check_divisibility(CONFIG, make_mesh(2, 2, 2), batch_size=6)
    check_divisibility(CONFIG, make_mesh(2, 2, 2), batch_size=8)


def test_3_heads_on_a_model_axis_of_2(monkeypatch):
    _no_compiles(monkeypatch)
    config = CONFIG.replace(d_model=48, n_heads=3, n_kv_heads=3)
    mesh = make_mesh(4, 1, 2)
    with pytest.raises(MeshError, match=r"n_heads = 3 does not divide .*model = 2"):
        check_divisibility(config, mesh, batch_size=8)
    with pytest.raises(MeshError, match=r"n_heads = 3 .*model = 2"):
        shard_model(BlockDiffusionLM(config, key=jax.random.key(0)), mesh)


def test_hidden_sizes_name_their_axis():
    with pytest.raises(MeshError, match=r"d_ff = 66 .*model = 4"):
        check_divisibility(CONFIG.replace(n_kv_heads=4, d_ff=66), make_mesh(2, 1, 4))
    with pytest.raises(MeshError, match=r"d_model = 36 .*fsdp = 8"):
        check_divisibility(CONFIG.replace(d_model=36, n_heads=2, n_kv_heads=2), make_mesh(1, 8, 1))


def test_mesh_errors_are_config_errors():
    # one ConfigError for the whole project: bd_models re-exports bd_core's, and MeshError is one
    assert bd_models.ConfigError is bd_core.ConfigError and issubclass(MeshError, bd_core.ConfigError)

