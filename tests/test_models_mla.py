"""W_UK / W_UV from kv_b_proj, checked against transformers' own expansion, and the
latent handed to pagedkv's attention only under its name."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs pagedkv[models] (transformers)")

from pagedkv.backends.mla.absorb import absorb_query, up_project
from pagedkv.models import ModelSupportError, builtin_config, random_model
from pagedkv.models.mla import pass_latent_through, split_kv_b_proj


@pytest.fixture(scope="module")
def attention():
    model = random_model(
        builtin_config("tiny-deepseek-v3"), dtype=torch.float64, device="cpu", seed=0
    )
    return model.model.layers[0].self_attn


def test_split_matches_transformers_expand_kv(attention):
    m = attention
    kv_c = torch.randn(1, 1, 7, m.kv_lora_rank, dtype=torch.float64)
    k_rot = torch.randn(1, 1, 7, m.qk_rope_head_dim, dtype=torch.float64)
    key, value = type(m).expand_kv(m, kv_c, k_rot)  # [1, H, T, nope + R], [1, H, T, v]
    w_uk, w_uv = split_kv_b_proj(
        m.kv_b_proj.weight, m.config.num_attention_heads, m.qk_nope_head_dim, m.v_head_dim
    )
    assert w_uk.shape == (m.kv_lora_rank, m.config.num_attention_heads, m.qk_nope_head_dim)
    k_nope = torch.einsum("tl,lhd->htd", kv_c[0, 0], w_uk)
    torch.testing.assert_close(k_nope, key[0, :, :, : m.qk_nope_head_dim])
    torch.testing.assert_close(torch.einsum("tl,lhd->htd", kv_c[0, 0], w_uv), value[0])


def test_absorbed_scores_and_outputs_equal_the_expanded_ones(attention):
    m = attention
    heads = m.config.num_attention_heads
    w_uk, w_uv = split_kv_b_proj(m.kv_b_proj.weight, heads, m.qk_nope_head_dim, m.v_head_dim)
    kv_c = torch.randn(9, m.kv_lora_rank, dtype=torch.float64)
    q_nope = torch.randn(3, heads, m.qk_nope_head_dim, dtype=torch.float64)
    expanded_k = torch.einsum("sl,lhd->shd", kv_c, w_uk)
    scores = torch.einsum("qhd,shd->hqs", q_nope, expanded_k)
    absorbed = torch.einsum("qhl,sl->hqs", absorb_query(q_nope, w_uk), kv_c)
    torch.testing.assert_close(absorbed, scores)
    p = scores.softmax(-1)
    expanded_out = torch.einsum("hqs,shd->qhd", p, torch.einsum("sl,lhd->shd", kv_c, w_uv))
    latent_out = torch.einsum("hqs,sl->qhl", p, kv_c)
    torch.testing.assert_close(up_project(latent_out, w_uv), expanded_out)


def test_split_rejects_a_wrong_shape():
    with pytest.raises(ModelSupportError, match=r"kv_b_proj.weight: expected \[num_heads"):
        split_kv_b_proj(torch.zeros(100, 32), 4, 16, 16)


def test_latent_passes_through_only_under_pagedkv(attention):
    m = attention
    pass_latent_through(m, "pagedkv")
    kv_c = torch.randn(1, 1, 5, m.kv_lora_rank, dtype=torch.float64)
    k_rot = torch.randn(1, 1, 5, m.qk_rope_head_dim, dtype=torch.float64)
    saved = m.config._attn_implementation
    try:
        m.config._attn_implementation = "pagedkv"
        latent, value = m.expand_kv(kv_c, k_rot)
        assert value is None and torch.equal(latent, torch.cat((kv_c, k_rot), -1))
        m.config._attn_implementation = "eager"
        key, value = m.expand_kv(kv_c, k_rot)
        assert key.shape[1] == m.config.num_attention_heads and value is not None
    finally:
        m.config._attn_implementation = saved
