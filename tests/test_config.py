"""EngineConfig: bad values and unknown fields fail, naming the field."""

from __future__ import annotations

import pytest

from jitney import EngineConfig


def test_defaults_follow_the_seed():
    config = EngineConfig()
    assert config.scheduler == "fifo"
    assert config.max_memory_percent == 0.9
    assert config.allow_block_sharing is True


@pytest.mark.parametrize(
    "field, value",
    [("block_size", 2), ("num_blocks", 0), ("max_batch_tokens", 0), ("max_memory_percent", 1.5),
     ("safety_margin", -0.1), ("max_requests_per_batch", "many"), ("allow_block_sharing", "yes"),
     ("chunk_context_cost", -0.5)],
)
def test_bad_value_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**{field: value})


def test_unknown_field_is_an_error():
    with pytest.raises(TypeError, match="max_batch_tokenz"):
        EngineConfig(max_batch_tokenz=3)
    with pytest.raises(ValueError, match="max_batch_tokenz"):
        EngineConfig.from_dict({"max_batch_tokenz": 3})


def test_from_dict_validates():
    assert EngineConfig.from_dict({"block_size": 8}).block_size == 8
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_dict({"block_size": 3})
