"""build_batch (C02): slots stay inside each request's own blocks, padding goes
to the null block, and the offsets are checked by hand."""

import numpy as np
import pytest

from jaxserve.worker.input_batch import build_batch
from jaxserve.scheduler.output import ScheduledRequest, SchedulerOutput
from jaxserve.worker.fake_runner import FakeRunner

from ._util import make_req, make_scheduler

B = 4


def _out(rows, t_pad, s_pad):
    return SchedulerOutput(tuple(rows), sum(len(r.token_ids) for r in rows), t_pad, s_pad, (), (), 1)


def _mixed():
    # Prompts of 5, 7 and 13 tokens (not multiples of B=4) on permuted blocks, plus a decode.
    return [
        ScheduledRequest("a", tuple(range(100, 105)), 0, (7, 2), True, 0),
        ScheduledRequest("b", tuple(range(200, 207)), 0, (5, 9), True, 0),
        ScheduledRequest("c", tuple(range(300, 313)), 0, (3, 8, 1, 6), True, 0),
        ScheduledRequest("d", (400,), 9, (4, 10, 11), True, 3),
    ]


def test_mixed_batch_hand_checked():
    b = build_batch(_out(_mixed(), 32, 8), block_size=B, max_blocks_per_seq=5)
    assert b.input_ids.dtype == np.int32 and b.input_ids.shape == (32,)
    assert int(b.num_seqs) == 4 and int(b.num_tokens) == 26
    np.testing.assert_array_equal(b.query_start_loc, [0, 5, 12, 25, 26, 26, 26, 26, 26])
    np.testing.assert_array_equal(b.seq_lens, [5, 7, 13, 10, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.logits_indices, [4, 11, 24, 25, 0, 0, 0, 0])
    np.testing.assert_array_equal(b.positions[:26], list(range(5)) + list(range(7)) + list(range(13)) + [9])
    np.testing.assert_array_equal(b.positions[26:], 0)
    np.testing.assert_array_equal(b.input_ids[:5], range(100, 105))
    np.testing.assert_array_equal(b.input_ids[25:], [400] + [0] * 6)
    # a: positions 0..3 -> block 7, position 4 -> block 2.
    np.testing.assert_array_equal(b.slot_mapping[:5], [28, 29, 30, 31, 8])
    # b: 0..3 -> block 5, 4..6 -> block 9.
    np.testing.assert_array_equal(b.slot_mapping[5:12], [20, 21, 22, 23, 36, 37, 38])
    # c: blocks 3, 8, 1, 6 (position 12 -> block 6 offset 0).
    np.testing.assert_array_equal(b.slot_mapping[12:25], [12, 13, 14, 15, 32, 33, 34, 35, 4, 5, 6, 7, 24])
    # d: position 9 -> block index 2 = 11, offset 1.
    assert b.slot_mapping[25] == 45
    assert (b.slot_mapping[26:] < B).all()  # padding inside the null block
    np.testing.assert_array_equal(b.block_table[2], [3, 8, 1, 6, 0])
    np.testing.assert_array_equal(b.block_table[4:], 0)


def _check_slots(out, b):
    seen = set()
    for i, r in enumerate(out.scheduled):
        lo, hi = b.query_start_loc[i], b.query_start_loc[i + 1]
        own = {blk * B + o for blk in r.block_ids for o in range(B)}
        for s in b.slot_mapping[lo:hi]:
            assert int(s) in own and int(s) >= B  # own blocks, never block 0
            assert int(s) not in seen  # no two real tokens share a slot
            seen.add(int(s))


def test_slots_in_own_blocks_and_unique():
    out = _out(_mixed(), 32, 8)
    _check_slots(out, build_batch(out, block_size=B, max_blocks_per_seq=5))


def test_larger_bucket_only_adds_padding():
    small = build_batch(_out(_mixed(), 32, 4), block_size=B, max_blocks_per_seq=5)
    big = build_batch(_out(_mixed(), 64, 8), block_size=B, max_blocks_per_seq=5)
    T = 26
    for f in ("input_ids", "positions", "slot_mapping"):
        np.testing.assert_array_equal(getattr(small, f)[:T], getattr(big, f)[:T])
    np.testing.assert_array_equal(small.query_start_loc[:5], big.query_start_loc[:5])
    np.testing.assert_array_equal(small.block_table[:4], big.block_table[:4])


def test_empty_plan_is_all_padding():
    b = build_batch(_out([], 16, 4), block_size=B, max_blocks_per_seq=3)
    assert int(b.num_seqs) == 0 and int(b.num_tokens) == 0
    np.testing.assert_array_equal(b.query_start_loc, 0)
    assert (b.slot_mapping < B).all() and b.block_table.shape == (4, 3)


def test_errors():
    rows = _mixed()
    with pytest.raises(ValueError, match="26 scheduled tokens exceed token_bucket=16"):
        build_batch(_out(rows, 16, 8), block_size=B, max_blocks_per_seq=5)
    with pytest.raises(ValueError, match="4 scheduled rows exceed seq_bucket=2"):
        build_batch(_out(rows, 32, 2), block_size=B, max_blocks_per_seq=5)
    with pytest.raises(ValueError, match="'c' holds 4 blocks > max_blocks_per_seq=3"):
        build_batch(_out(rows, 32, 8), block_size=B, max_blocks_per_seq=3)
    short = [ScheduledRequest("e", tuple(range(9)), 0, (1, 2), True, 0)]
    with pytest.raises(ValueError, match="cannot hold positions up to 8"):
        build_batch(_out(short, 16, 1), block_size=B, max_blocks_per_seq=4)


def _reference(out, block_size, max_blocks):
    """Per-token loop (independent of the vectorised code)."""
    T_pad, S_pad = out.token_bucket, out.seq_bucket
    ids, pos, slots = [0] * T_pad, [0] * T_pad, [t % block_size for t in range(T_pad)]
    t = 0
    for r in out.scheduled:
        for k, tok in enumerate(r.token_ids):
            p = r.start_pos + k
            ids[t], pos[t] = tok, p
            slots[t] = r.block_ids[p // block_size] * block_size + p % block_size
            t += 1
    return ids, pos, slots


def test_against_per_token_reference_on_real_schedules():
    s = make_scheduler(budget=24, max_seqs=5, block_size=B, num_kv_blocks=40, threshold=10)
    for i in range(9):
        s.add_request(make_req(f"r{i}", 3 + 5 * i, max_tokens=12))
    steps = []
    FakeRunner(s, build_batches=True, on_step=steps.append).run()
    assert len(steps) > 10
    for st in steps:
        if not st.out.scheduled:
            continue
        ids, pos, slots = _reference(st.out, B, s.max_blocks_per_seq)
        np.testing.assert_array_equal(st.batch.input_ids, ids)
        np.testing.assert_array_equal(st.batch.positions, pos)
        np.testing.assert_array_equal(st.batch.slot_mapping, slots)
        _check_slots(st.out, st.batch)
