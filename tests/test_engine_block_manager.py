"""The block manager and the scheduler's use of it, without a model: allocation, free, growth block by
block, shrinking only free tail blocks, and preemption of the youngest running sequence."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.scheduler import Scheduler, Status
from engine_helpers import make_seq


def seq(n_tokens: int, name: str = "s"):
    return make_seq(name, list(range(1, n_tokens + 1)), max_tokens=100, ignore_eos=True)


def test_allocation_takes_the_lowest_free_blocks_and_free_gives_them_back():
    bm = BlockManager(8, block_size=4)
    a, b = seq(5, "a"), seq(4, "b")
    bm.allocate(a)
    bm.allocate(b)
    assert a.block_table == [0, 1] and b.block_table == [2]
    assert (bm.num_used, bm.num_free) == (3, 5)
    bm.free(a)
    assert a.block_table == [] and bm.num_free == 7
    c = seq(9, "c")
    bm.allocate(c)
    assert c.block_table == [0, 1, 3]  # the freed ids first, lowest first
    assert not bm.can_allocate(seq(17)) and bm.can_allocate(seq(16))


def test_a_sequence_grows_one_block_when_its_last_block_is_full():
    bm = BlockManager(2, block_size=4)
    s = seq(3)
    bm.allocate(s)
    s.output_ids.append(9)  # length 4: the next decode writes position 3, still in block 0
    assert bm.can_append(s)
    bm.may_append(s)
    assert s.block_table == [0]
    s.output_ids.append(9)  # length 5: position 4 needs a second block
    bm.may_append(s)
    assert s.block_table == [0, 1]
    s.output_ids += [9] * 4  # length 9: a third block, and there is none
    assert not bm.can_append(s)


def test_resize_grows_free_ids_and_shrinks_only_a_free_tail():
    bm = BlockManager(4, block_size=2)
    s = seq(3)
    bm.allocate(s)
    assert bm.free_tail() == 2
    bm.resize(6)
    assert (bm.num_blocks, bm.num_free, bm.free_tail()) == (6, 4, 4)
    bm.resize(2)
    assert (bm.num_blocks, bm.num_free, bm.free_tail()) == (2, 0, 0)
    with pytest.raises(AssertionError, match="used block"):
        bm.resize(1)
    bm.free(s)
    assert bm.free_tail() == 2


def test_out_of_blocks_preempts_the_youngest_and_requeues_it_first():
    bm = BlockManager(4, block_size=2)
    sched = Scheduler(bm, max_batch=8, max_len=8, eos_ids=())
    a, b, c = seq(2, "a"), seq(2, "b"), seq(2, "c")
    for s in (a, b, c):
        sched.add(s)
    prefill, decode = sched.schedule()
    assert prefill == [a, b, c] and decode == [] and bm.num_free == 1
    for s in prefill:
        sched.append(s, 7)  # length 3: each needs a second block for its next decode
    prefill, decode = sched.schedule()
    assert prefill == [] and decode == [a, b]  # a took the free block, b took c's
    assert c.status is Status.WAITING and c.block_table == [] and c.preemptions == 1
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    for s in decode:
        sched.append(s, 7)  # length 4: still two blocks each
    assert sched.schedule() == ([], [a, b])  # c does not fit yet: admission waits
    for s in (a, b):
        sched.append(s, 7)  # length 5: a needs a third block; b, the youngest running, goes
    assert sched.schedule() == ([], [a])
    assert list(sched.waiting) == [b, c] and sched.preemptions == 2
    # the victims come back with their tokens so far, to be prefilled again (recompute)
    sched.finish(a, "stop")
    prefill, _ = sched.schedule()
    assert prefill == [b] and len(b.block_table) == 3 and b.all_ids == [1, 2, 7, 7, 7]
    assert list(sched.waiting) == [c]  # 2 more blocks needed, 1 free


def test_admission_waits_for_the_batch_cap_and_for_blocks_in_arrival_order():
    bm = BlockManager(3, block_size=2)
    sched = Scheduler(bm, max_batch=2, max_len=16, eos_ids=())
    long, short1, short2 = seq(5, "long"), seq(1, "s1"), seq(1, "s2")
    for s in (short1, long, short2):
        sched.add(s)
    prefill, _ = sched.schedule()
    assert prefill == [short1]  # long needs 3 blocks, 2 are free; short2 may not overtake it
    sched.finish(short1, "stop")
    prefill, _ = sched.schedule()
    assert prefill == [long] and bm.num_free == 0


def test_runways_keep_a_sequence_in_consecutive_blocks_as_it_grows():
    bm = BlockManager(16, block_size=4, runways=True)
    a, b = seq(5, "a"), seq(4, "b")
    bm.allocate(a, upto=16)  # 2 blocks now, 4 in all: a runway of 2
    bm.allocate(b, upto=8)
    assert a.block_table == [0, 1] and b.block_table == [4]  # b placed after a's runway
    assert (bm.num_used, bm.num_free) == (3, 13)  # a runway's blocks count as free
    a.output_ids += [9] * 4  # length 9: a third block, the next id
    bm.may_append(a)
    b.output_ids += [9] * 1  # length 5: b's second block, from its runway
    bm.may_append(b)
    assert a.block_table == [0, 1, 2] and b.block_table == [4, 5]
    bm.free(a)  # its runway too
    assert bm.num_free == 14 and bm.num_used == 2
    c = seq(13, "c")  # 4 blocks: the lowest free run that holds them is 0..3
    bm.allocate(c, upto=13)
    assert c.block_table == [0, 1, 2, 3]


def test_runways_never_refuse_a_block_and_a_shrink_cuts_them():
    bm = BlockManager(8, block_size=4, runways=True)
    a = seq(4, "a")
    bm.allocate(a, upto=32)  # the whole pool: 1 block used, 7 reserved
    b = seq(9, "b")
    assert bm.can_allocate(b)
    bm.allocate(b)  # no free run outside the runway: it takes the runway's last blocks
    assert b.block_table == [7, 6, 5] and bm.num_free == 4
    a.output_ids.append(9)
    bm.may_append(a)
    assert a.block_table == [0, 1]  # the runway's head is still a's
    bm.free(b)
    assert bm.free_tail() == 6
    bm.resize(3)  # cuts a's runway at the new end
    assert bm.num_free == 1
    a.output_ids += [9] * 4
    bm.may_append(a)
    assert a.block_table == [0, 1, 2] and bm.num_free == 0


def test_without_runways_growth_takes_the_lowest_free_block():
    bm = BlockManager(8, block_size=4)
    a, b = seq(4, "a"), seq(4, "b")
    bm.allocate(a, upto=32)
    bm.allocate(b, upto=32)
    a.output_ids.append(9)
    bm.may_append(a)
    assert a.block_table == [0, 2] and b.block_table == [1]
