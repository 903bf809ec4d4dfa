"""`ConfigError` and its message builder: owner.field, what was expected, the value given, the fix."""

import pytest

from bd_core import ConfigError, config_error


def test_message_names_owner_field_value_and_fix():
    err = config_error("CanvasConfig", "prompt_len", 6, "a multiple of block_size=4", "round it up to 8")
    assert isinstance(err, ConfigError) and isinstance(err, ValueError)
    assert str(err) == "CanvasConfig.prompt_len: expected a multiple of block_size=4, got 6; round it up to 8"


def test_without_owner_or_fix():
    assert str(config_error("", "task", "mul", "one of ['sort']")) == "task: expected one of ['sort'], got 'mul'"


def test_it_is_raised_and_caught_as_one_type():
    with pytest.raises(ConfigError, match=r"^Owner\.field: expected a bool, got 'yes'$"):
        raise config_error("Owner", "field", "yes", "a bool")
