"""MXFP4 decoding is bit-exact against both references' decoders."""

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from gptoss_jax.mxfp4 import decode_mxfp4


def _random_packed(rng, prefix=(3, 5), groups=4):
    blocks = rng.integers(0, 256, size=(*prefix, groups, 16), dtype=np.uint8)
    scales = rng.integers(0, 256, size=(*prefix, groups), dtype=np.uint8)
    # Extreme exponents and signed zeros in every draw: scale 0 (2^-127), 255 (2^128), 127 (2^0);
    # bytes 0x80 / 0x08 put code 8 (-0.0) in one nibble and +0.0 in the other.
    scales[0, 0, :3] = [0, 255, 127]
    blocks[0, 0, 0, :4] = [0x80, 0x08, 0x88, 0x00]
    blocks[0, 0, 1, :2] = [0x7F, 0xF7]  # +6/-6 at scale 255: overflow to +-inf
    return blocks, scales


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy()


def test_decode_is_bit_exact_against_openai(tmp_path):
    from gpt_oss.torch.weights import Checkpoint

    blocks, scales = _random_packed(np.random.default_rng(0))
    save_file({"w.blocks": blocks, "w.scales": scales}, tmp_path / "model.safetensors")
    ref = Checkpoint(str(tmp_path), torch.device("cpu"))._get_mxfp4_tensor("w.blocks", "w.scales",
                                                                          dtype=torch.bfloat16)
    ours = decode_mxfp4(blocks, scales, "bfloat16")
    assert ours.shape == tuple(ref.shape) == (3, 5, 4 * 32)
    np.testing.assert_array_equal(ours.view(np.int16), _bits(ref))
    # The planted cases: signed zeros kept, 2^-127 scaling exact, overflow to inf.
    # Byte 0x80: +0.0 (low nibble, even element) then -0.0 (high nibble, odd element).
    assert not np.signbit(ours[0, 0, 0]) and np.signbit(ours[0, 0, 1])
    # Group 1 has scale 255 (2^128): bytes 0x7F, 0xF7 decode to -6, +6, +6, -6 and overflow.
    np.testing.assert_array_equal(ours[0, 0, 32:36].astype(np.float32), [-np.inf, np.inf, np.inf, -np.inf])


def test_decode_is_bit_exact_against_hf():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_packed(np.random.default_rng(1))
    ref = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.bfloat16)
    ours = decode_mxfp4(blocks, scales, "bfloat16")
    # HF returns the decoded experts transposed, [..., in, out], for its [E, in, out] matmuls.
    assert tuple(ref.shape) == (3, 4 * 32, 5)
    ref = ref.transpose(-1, -2)
    np.testing.assert_array_equal(ours.view(np.int16), _bits(ref))


def test_decode_values_and_layout():
    # One block: byte i holds codes (2i mod 16) low and (2i+1 mod 16) high -> values in table order.
    codes = np.arange(32) % 16
    block = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)[None]  # [1, 16]
    table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    for scale, factor in ((127, 1.0), (128, 2.0), (0, 2.0 ** -127)):
        out = decode_mxfp4(block, np.array([scale], np.uint8), "float32")
        np.testing.assert_array_equal(out, np.tile(table, 2) * np.float32(factor))
    np.testing.assert_array_equal(np.signbit(out[8]), True)  # code 8 is -0.0


@pytest.mark.parametrize("blocks, scales, message", [
    (np.zeros((2, 16), np.int8), np.zeros(2, np.uint8), "uint8"),
    (np.zeros((2, 15), np.uint8), np.zeros(2, np.uint8), "do not match"),
    (np.zeros((2, 16), np.uint8), np.zeros(3, np.uint8), "do not match"),
])
def test_decode_rejects_bad_inputs(blocks, scales, message):
    with pytest.raises(ValueError, match=message):
        decode_mxfp4(blocks, scales)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_table_lookup_equals_the_formula_for_every_scale_and_byte(dtype):
    from gptoss_jax.mxfp4 import decode_mxfp4_reference, unpack_experts

    # All 256 x 256 (scale, byte) combinations, bit for bit.
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(16, 16), (256, 1, 1)).reshape(256, 16, 16)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    fast, slow = decode_mxfp4(blocks, scales, dtype), decode_mxfp4_reference(blocks, scales, dtype)
    width = np.int16 if dtype == "bfloat16" else np.int32
    np.testing.assert_array_equal(fast.view(width), slow.view(width))
    # unpack_experts decodes expert by expert into [E, out, in].
    np.testing.assert_array_equal(unpack_experts(blocks[None], scales[None], dtype).view(width), fast[None].view(width))
