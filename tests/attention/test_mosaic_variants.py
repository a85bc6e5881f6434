"""Mosaic kernel variants in the GPU interpreter: fp32 (bf16x3), warp specialization,
pipeline depths and chunk sizes; the tile checks and the host metadata by hand.

See test_mosaic_attention.py for what the interpreter simulates and how batches
are poisoned.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jaxserve.attention.common import CommonAttentionMetadata, host_common
from jaxserve.attention.pallas_mosaic import mosaic_metadata
from jaxserve.attention.kernels import ragged_paged_attention_mosaic as rpm
from tests.attention.test_mosaic_attention import B, MIXES, assert_matches, run_case

MIXED = MIXES["mixed"]


@pytest.mark.parametrize("d", [64, 128])
def test_fp32_bf16x3_path_matches_reference(d):
    # bf16x3 keeps ~2^-16 relative error: 5e-5 here, where plain bf16 needs 2e-2.
    tiles = rpm.default_tiles(4, B, head_dim=d, dtype=jnp.float32)
    assert tiles.pipeline_depth == (2 if d == 64 else 1)  # d=128: two slots do not fit
    out, ref, n = run_case(*MIXED, h=4, k=1, d=d, dtype=jnp.float32, tiles=tiles)
    assert_matches(out, ref, n, dtype=jnp.float32)
    assert np.abs(out[:n] - ref[:n]).max() < 5e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_warp_specialized_producer_has_no_races(dtype):
    # num_warpgroups=2: a copy warpgroup and a compute warpgroup meet only at barriers
    # (3 chunks, 2 slots: one slot is freed and refilled; fp32 frees it after its split);
    # the interpreter's happens-before race detector raises on an unordered access.
    tiles = dataclasses.replace(rpm.default_tiles(4, B, head_dim=64), num_warpgroups=2)
    params = plgpu.InterpretGPUParams(detect_races=True)
    out, ref, n = run_case([1, 3], [130, 3 + 70], h=4, k=1, d=64, tiles=tiles, dtype=dtype,
                           num_tokens=16, max_pages=9, interpret=params)
    assert_matches(out, ref, n, dtype=dtype)


@pytest.mark.parametrize("ppc,depth", [(8, 3), (4, 1)])
def test_chunk_sizes_and_pipeline_depths(ppc, depth):
    # 4 chunks either way: 128-key chunks with 3 slots (the first slot is refilled), and
    # a single slot (no overlap: each chunk's load waits for the previous chunk's MMAs).
    tiles = rpm.MosaicTiles(block_q=16, pages_per_chunk=ppc, pipeline_depth=depth)
    keys = 4 * ppc * B
    assert_matches(*run_case([1, 6], [keys, 6 + keys - 20], h=4, k=1, d=64, tiles=tiles,
                             num_tokens=16, max_pages=keys // B, seed=ppc))


def test_check_tiles_names_the_bad_value():
    ok = dict(num_queries_per_kv=4, block_size=16, head_dim=64, dtype=jnp.bfloat16)
    rpm.check_tiles(rpm.MosaicTiles(), **ok)
    cases = [(dict(block_q=8), "block_q \\* next_pow2\\(H/K\\)=32"),
             (dict(pages_per_chunk=2), "pages_per_chunk \\* block_size=32"),
             (dict(num_warpgroups=3), "num_warpgroups=3")]
    for change, match in cases:
        with pytest.raises(ValueError, match=match):
            rpm.check_tiles(rpm.MosaicTiles(**change), **ok)
    with pytest.raises(ValueError, match="block_size=4"):
        rpm.check_tiles(rpm.MosaicTiles(pages_per_chunk=16), **{**ok, "block_size": 4})
    with pytest.raises(ValueError, match="head_dim=8"):
        rpm.check_tiles(rpm.MosaicTiles(), **{**ok, "head_dim": 8})
    with pytest.raises(ValueError, match="dtype=float16"):
        rpm.check_tiles(rpm.MosaicTiles(), **{**ok, "dtype": jnp.float16})
    with pytest.raises(ValueError, match="shared memory"):  # fp32 d=128 with 2 slots
        rpm.check_tiles(rpm.MosaicTiles(), **{**ok, "head_dim": 128, "dtype": jnp.float32})


def test_smem_bytes_by_hand():
    # bf16, M=64, CK=64, D=128, 2 slots: Q 16 KiB + K,V 2x2x16 KiB + P 8 KiB = 88 KiB.
    assert rpm.smem_bytes(rpm.MosaicTiles(), num_queries_per_kv=4, block_size=16,
                          head_dim=128, dtype=jnp.bfloat16) == 88 * 1024


def test_metadata_hand_example():
    # seqs: q_len 5 at ctx 3 (positions 3..7), a zero-query seq, q_len 1 at ctx 9,
    # a padded slot; block_q 4; block table 3 wide -> padded to 4 (pages_per_chunk).
    tiles = rpm.MosaicTiles(block_q=4, pages_per_chunk=4)
    bt = np.array([[5, 6, 0], [7, 0, 0], [2, 3, 0], [0, 0, 0]])
    common = host_common(CommonAttentionMetadata(
        slot_mapping=np.zeros(8), query_start_loc=np.array([0, 5, 5, 6, 6]),
        seq_lens=np.array([8, 4, 10, 0]), block_table=bt, num_seqs=3), block_size=B)
    md = mosaic_metadata(common, tiles)
    np.testing.assert_array_equal(md.block_table, np.pad(bt, ((0, 0), (0, 1))))
    used = 3
    np.testing.assert_array_equal(md.tile_seq[:used], [0, 0, 2])
    np.testing.assert_array_equal(md.tile_q_start[:used], [0, 4, 5])
    np.testing.assert_array_equal(md.tile_pos0[:used], [3, 7, 9])
    np.testing.assert_array_equal(md.tile_kv_end[:used], [7, 8, 10])
    assert np.all(md.tile_kv_end[used:] == 0)
    # token -> row tile * 4 + r: tokens 0-3 tile 0, token 4 tile 1, token 5 tile 2; 6, 7 padding
    np.testing.assert_array_equal(md.token_out_row, [0, 1, 2, 3, 4, 8, -1, -1])
