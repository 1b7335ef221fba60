"""RMSNorm and RoPE/YaRN against both references.

Values are checked against the same formula in float64 on the same inputs, within NOISE_FACTOR x a
reference's own float32 (or bfloat16) error (noise.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gptoss_jax as gj
from noise import Exact
from gptoss_jax.model import layers
from gptoss_jax.model.layers import RMSNorm, apply_rope, rope_inv_freq, rope_tables
from refs import hf_config, t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rmsnorm_matches_both_references(tiny, dtype):
    from gpt_oss.torch.model import RMSNorm as OpenAINorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    rng = np.random.default_rng(0)
    x = (3 * rng.standard_normal((2, 7, tiny.hidden_size))).astype(np.float32)
    scale = (1 + 0.3 * rng.standard_normal(tiny.hidden_size)).astype(np.float32)
    tdtype = torch.float32 if dtype == "float32" else torch.bfloat16
    xj = jnp.asarray(x, dtype)
    ours = RMSNorm(tiny).apply({"params": {"scale": jnp.asarray(scale)}}, xj)
    assert ours.dtype == xj.dtype
    ref_o, ref_h = OpenAINorm(tiny.hidden_size), GptOssRMSNorm(tiny.hidden_size, eps=tiny.rms_norm_eps)
    x64 = np.asarray(xj.astype(jnp.float32), np.float64)  # the input as both sides see it
    exact = x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + tiny.rms_norm_eps) * scale
    with torch.no_grad():
        ref_o.scale.copy_(t(scale))
        ref_h.weight.copy_(t(scale))
        for name, ref in (("openai", ref_o(t(x, tdtype))), ("hf", ref_h(t(x, tdtype)))):
            Exact.measure(ref.double().numpy(), exact, precision=dtype).check(ours, name)


def _ref_inv_freq(config):
    from gpt_oss.torch.model import RotaryEmbedding

    return RotaryEmbedding(config.head_dim, config.rope_theta, torch.float32,
                           initial_context_length=config.initial_context_length,
                           scaling_factor=config.rope_scaling_factor, ntk_alpha=config.rope_ntk_alpha,
                           ntk_beta=config.rope_ntk_beta)._compute_concentration_and_inv_freq()


def _openai_rope(config, n):
    from gpt_oss.torch.model import RotaryEmbedding

    return RotaryEmbedding(config.head_dim, config.rope_theta, torch.float32,
                           initial_context_length=config.initial_context_length,
                           scaling_factor=config.rope_scaling_factor, ntk_alpha=config.rope_ntk_alpha,
                           ntk_beta=config.rope_ntk_beta)._compute_cos_sin(n)


def _hf_rope(config, positions):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    rope = GptOssRotaryEmbedding(hf_config(config))
    return rope(torch.zeros(1), torch.from_numpy(positions.astype(np.int64))[None])


CONFIGS = {"tiny": gj.ModelConfig.tiny, "gpt-oss-20b": gj.ModelConfig.gpt_oss_20b}


@pytest.mark.parametrize("which", CONFIGS)
def test_inv_freq_is_exact_and_within_one_ulp_of_both_references(which):
    config = CONFIGS[which]()
    conc, inv = rope_inv_freq(config)
    ref_conc, ref_inv = _ref_inv_freq(config)
    assert conc == pytest.approx(ref_conc, rel=8 * np.finfo(np.float64).eps)  # the same float64 formula, another order
    np.testing.assert_array_max_ulp(inv, ref_inv.numpy(), maxulp=1)
    np.testing.assert_array_max_ulp(inv, GptOssRotaryEmbedding_inv_freq(config), maxulp=1)
    # YaRN is engaged: the fastest frequency is kept, the slowest divided by the scaling factor.
    plain = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2) / config.head_dim)
    # Each is that value rounded once to float32: within half an ulp, 2^-24 relative.
    assert inv[0] == pytest.approx(plain[0], rel=2 ** -24)
    assert inv[-1] == pytest.approx(plain[-1] / config.rope_scaling_factor, rel=2 ** -24)


def GptOssRotaryEmbedding_inv_freq(config):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    return GptOssRotaryEmbedding(hf_config(config)).inv_freq.numpy()


@pytest.mark.parametrize("which", CONFIGS)
def test_rope_tables_match_both_references_to_131072(which, monkeypatch):
    """The real 20b settings over the whole 131072-token context; the tiny config past its initial 256."""
    config = CONFIGS[which]()
    n = 131072 if which == "gpt-oss-20b" else 1024
    positions = np.arange(n, dtype=np.int32)
    ref_conc, ref_inv = _ref_inv_freq(config)
    ref_cos, ref_sin = (x.numpy() for x in _openai_rope(config, n))
    hf_cos, hf_sin = (x[0].numpy() for x in _hf_rope(config, positions))

    # 1. Given the references' own frequencies, the tables agree with cos and sin of the float32 angle
    # (all three codes round p * inv_freq to float32 first) taken in float64, to the references'
    # own rounding of cos, sin and the concentration.
    monkeypatch.setattr(layers, "rope_inv_freq", lambda c: (ref_conc, ref_inv.numpy()))
    cos, sin = rope_tables(config, jnp.asarray(positions))
    angle32 = np.asarray(positions[:, None].astype(np.float32) * ref_inv.numpy()[None, :], np.float64)
    exact = {"cos": np.cos(angle32) * ref_conc, "sin": np.sin(angle32) * ref_conc}
    for what, ours, ref in (("cos", cos, ref_cos), ("sin", sin, ref_sin), ("cos", cos, hf_cos), ("sin", sin, hf_sin)):
        Exact.measure(ref, exact[what]).check(ours, what)
    monkeypatch.undo()

    # 2. With our frequencies (within 1 ulp, above), the difference is what that ulp explains: the
    # angle moves by at most p * |d inv_freq| plus one float32 rounding of the angle.
    conc, inv = rope_inv_freq(config)
    cos, sin = (np.asarray(x) for x in rope_tables(config, jnp.asarray(positions)))
    angle = positions[:, None].astype(np.float32) * inv[None, :]
    # Plus each code's rounding of cos or sin and of the product by the concentration: an ulp of conc each.
    bound = conc * (positions[:, None] * np.abs(inv - ref_inv.numpy())[None, :] + np.spacing(np.abs(angle))
                    + 4 * np.finfo(np.float32).eps)
    for ours, ref in ((cos, ref_cos), (sin, ref_sin), (cos, hf_cos), (sin, hf_sin)):
        assert np.all(np.abs(ours - ref) <= bound)
    # Where the frequencies agree to the bit, the columns agree to rounding at every position.
    same = inv == ref_inv.numpy()
    assert same.sum() >= len(inv) // 2
    angle64 = np.asarray(angle, np.float64)
    Exact.measure(ref_cos[:, same], np.cos(angle64[:, same]) * conc).check(cos[:, same], "cos")
    Exact.measure(ref_sin[:, same], np.sin(angle64[:, same]) * conc).check(sin[:, same], "sin")


def test_apply_rope_matches_both_references():
    """Rotation alone (half-split pairs), given the same tables, at positions across the 20b context."""
    from gpt_oss.torch.model import _apply_rotary_emb
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb

    config = gj.ModelConfig.gpt_oss_20b()
    rng = np.random.default_rng(0)
    positions = np.array([0, 1, 127, 128, 4095, 4096, 65536, 131071], np.int32)
    q = rng.standard_normal((1, len(positions), 4, config.head_dim)).astype(np.float32)  # [B, T, N, H]
    k = rng.standard_normal((1, len(positions), 2, config.head_dim)).astype(np.float32)
    all_cos, all_sin = _openai_rope(config, 131072)
    cos, sin = all_cos[positions], all_sin[positions]  # [T, H/2]
    ours_q = apply_rope(jnp.asarray(q), jnp.asarray(cos.numpy())[None], jnp.asarray(sin.numpy())[None])
    ours_k = apply_rope(jnp.asarray(k), jnp.asarray(cos.numpy())[None], jnp.asarray(sin.numpy())[None])

    def rotated64(x):  # the rotation of the same tables, in float64: [B, T, N, H]
        c, s_ = (np.asarray(a, np.float64)[None, :, None, :] for a in (cos, sin))
        x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
        return np.concatenate([x1 * c - x2 * s_, x2 * c + x1 * s_], axis=-1)

    exact_q = Exact.measure(_apply_rotary_emb(t(q[0]), cos, sin).numpy(), rotated64(q)[0])
    exact_q.check(ours_q[0], "q, openai")
    hq, hk = apply_rotary_pos_emb(t(q).transpose(1, 2), t(k).transpose(1, 2), cos[None], sin[None])
    Exact.measure(hq.transpose(1, 2).numpy(), rotated64(q)).check(ours_q, "q, hf")
    Exact.measure(hk.transpose(1, 2).numpy(), rotated64(k)).check(ours_k, "k, hf")
    # Rotation is not the identity away from position 0, and it preserves norms up to the concentration.
    assert not np.allclose(ours_q[0, 4], q[0, 4], atol=1e-2)
