import math
import re

import numpy as np
import pytest
import torch
from pagedkv import AttentionSpec, Feature, SpecError
from pagedkv.spec import alibi_slopes


def make(**kw):
    base = dict(num_heads=8, num_kv_heads=2, head_size=64, dtype=torch.float16, block_size=16)
    base.update(kw)
    return AttentionSpec(**base)


def test_defaults():
    s = make()
    assert s.head_size_v == 64
    assert s.scale == pytest.approx(64**-0.5)
    assert s.num_queries_per_kv == 4
    assert s.cache_dtype == torch.float16
    assert s.required_features() == frozenset()
    assert s.kv_bytes_per_token() == 2 * 2 * 64 * 2


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 3}, "num_heads (8) must be a multiple of num_kv_heads (3)"),
        ({"head_size": 0}, "head_size must be a positive int"),
        ({"block_size": -16}, "block_size must be a positive int"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"kv_cache_dtype": "int8"}, "kv_cache_dtype must be one of"),
        ({"k_scale": 0.0}, "k_scale must be a finite positive number"),
        ({"sliding_window": 0}, "sliding_window must be a positive int"),
        ({"logits_soft_cap": -1.0}, "logits_soft_cap must be a finite positive number or None"),
        (
            {"alibi_slopes": (0.5, 0.25)},
            "alibi_slopes must have one slope per query head (8), got 2",
        ),
        ({"kv_lora_rank": 512}, "MLA needs both kv_lora_rank and qk_rope_head_dim"),
    ],
)
def test_invalid_specs_name_the_field(changes, message):
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make(**changes)


def test_mla_spec_needs_explicit_scale_and_geometry():
    kw = dict(num_heads=16, num_kv_heads=1, head_size=576, kv_lora_rank=512, qk_rope_head_dim=64)
    with pytest.raises(SpecError, match="MLA needs an explicit scale"):
        make(**kw)
    s = make(scale=192**-0.5, **kw)
    assert s.is_mla and s.head_size_v == 512 and s.scale == pytest.approx(192**-0.5)
    assert Feature.MLA in s.required_features()
    assert s.kv_bytes_per_token() == 576 * 2
    with pytest.raises(SpecError, match="MLA head_size must be"):
        make(scale=0.1, **{**kw, "head_size": 512})
    with pytest.raises(SpecError, match="num_kv_heads must be 1"):
        make(scale=0.1, **{**kw, "num_kv_heads": 2})


def test_required_features():
    s = make(
        sliding_window=8,
        logits_soft_cap=30.0,
        alibi_slopes=alibi_slopes(8),
        use_sinks=True,
        causal=False,
        kv_cache_dtype="fp8_e4m3",
    )
    assert s.required_features() == {
        Feature.SLIDING_WINDOW,
        Feature.LOGITS_SOFT_CAP,
        Feature.ALIBI,
        Feature.SINKS,
        Feature.NON_CAUSAL,
        Feature.FP8_KV,
    }
    assert s.cache_dtype == torch.float8_e4m3fn
    assert s.kv_bytes_per_token() == 2 * 2 * 64


def test_replace_rederives_scale():
    s = make().replace(head_size=128)
    assert s.scale == pytest.approx(128**-0.5) and s.head_size_v == 128


def test_alibi_slopes_non_power_of_two():
    slopes = alibi_slopes(12)
    assert len(slopes) == 12 and all(0 < x < 1 for x in slopes)
    assert alibi_slopes(8)[0] == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        # an infinite cap or slope makes every output NaN
        ({"logits_soft_cap": math.inf}, "logits_soft_cap must be a finite positive number"),
        ({"logits_soft_cap": math.nan}, "logits_soft_cap must be a finite positive number"),
        ({"alibi_slopes": (math.inf,) + (0.5,) * 7}, "alibi_slopes must be finite numbers"),
        ({"alibi_slopes": (math.nan,) + (0.5,) * 7}, "alibi_slopes must be finite numbers"),
        ({"alibi_slopes": ("0.5",) * 8}, "alibi_slopes must be finite numbers"),
        ({"scale": math.inf}, "scale must be a finite positive number"),
        ({"k_scale": math.inf}, "k_scale must be a finite positive number"),
        ({"v_scale": True}, "v_scale must be a finite positive number, got True"),
        # zero is a value, not "unset"
        ({"head_size_v": 0}, "head_size_v must be a positive int or None, got 0"),
        # a bool is not an int, a float is not an int
        ({"sliding_window": True}, "sliding_window must be a positive int or None, got True"),
        ({"head_size_v": 64.0}, "head_size_v must be a positive int or None, got 64.0"),
        ({"head_size": 64.0}, "head_size must be a positive int, got 64.0"),
        ({"num_kv_heads": True}, "num_kv_heads must be a positive int, got True"),
        ({"causal": 1}, "causal must be a bool, got 1"),
        ({"use_sinks": None}, "use_sinks must be a bool, got None"),
        ({"dtype": "float16"}, "dtype must be a torch.dtype, got 'float16'"),
        ({"kv_cache_dtype": ["auto"]}, "kv_cache_dtype must be a str"),
    ],
)
def test_field_types_and_finiteness(changes, message):
    with pytest.raises(SpecError, match=re.escape(message)):
        make(**changes)


def test_numbers_of_other_libraries_become_python_numbers():
    s = make(head_size=np.int64(64), alibi_slopes=torch.tensor(alibi_slopes(8)))
    assert type(s.head_size) is int and s.head_size_v == 64
    assert s.alibi_slopes == pytest.approx(alibi_slopes(8))
    assert all(type(x) is float for x in s.alibi_slopes)
