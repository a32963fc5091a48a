"""Recycled result buffers (collective.pool): reused once unreferenced, never while referenced."""

from __future__ import annotations

import threading

import numpy as np

from collective.config import CollectiveConfig
from collective.pool import MIN_BYTES, Pool, pool
from collective.runtime import Runtime

ELEMENTS = MIN_BYTES // 4


def test_a_block_is_reused_only_once_nothing_refers_to_it() -> None:
    blocks = Pool(1 << 30)
    first = blocks.empty((ELEMENTS,), np.float32)
    address = first.ctypes.data
    held = [blocks.empty((ELEMENTS,), np.float32)]  # ``first`` is alive: a new block
    view = first.reshape(2, -1)[1]
    exported = memoryview(first[:4])
    del first
    held.append(blocks.empty((ELEMENTS,), np.float32))  # a view lives: a new block
    del view
    held.append(blocks.empty((ELEMENTS,), np.float32))  # a memoryview lives: a new block
    assert address not in {array.ctypes.data for array in held} and blocks.reused == 0
    del exported
    again = blocks.empty((2, ELEMENTS // 2), np.int32)  # any shape and dtype of the same size
    assert again.ctypes.data == address and again.shape == (2, ELEMENTS // 2) and blocks.reused == 1


def test_small_arrays_are_not_pooled_and_the_pool_is_bounded() -> None:
    blocks = Pool(3 * MIN_BYTES)
    assert blocks.empty((10,), np.float32).base is None
    arrays = [blocks.empty((ELEMENTS,), np.float32) for _ in range(5)]
    assert [array.base is not None for array in arrays] == [True] * 3 + [False] * 2  # past the limit: plain
    assert blocks.idle_bytes() == 0
    del arrays
    assert blocks.idle_bytes() == 3 * MIN_BYTES  # what stays idle is within the limit
    kept = [blocks.empty((ELEMENTS,), np.float32) for _ in range(3)]
    assert blocks.reused == 3  # the idle blocks are handed out again
    del kept
    bigger = blocks.empty((2 * ELEMENTS,), np.float32)  # room made by dropping idle blocks
    assert bigger.base is not None and blocks.idle_bytes() == MIN_BYTES
    assert blocks.empty((3 * ELEMENTS,), np.float32).base is None  # no idle block can make room
    del bigger
    assert blocks.idle_bytes() == 3 * MIN_BYTES
    assert Pool(0).empty((ELEMENTS,), np.float32).base is None  # a limit of 0: no pooling


def test_results_without_out_reuse_the_previous_results_memory() -> None:
    """4 peers, ``y = all_reduce(x)`` in a loop: every result right, their memory recycled."""
    config = CollectiveConfig(num_devices=4, timeout=30)
    before = pool.reused
    errors: list[BaseException] = []
    with Runtime() as runtime:

        def peer(rank: int) -> None:
            try:
                runtime.register(rank, "cpu", config)
                kept = []
                for i in range(6):
                    y = runtime.all_reduce(rank, np.full(2 * ELEMENTS, rank + i, np.float32))
                    kept.append(y) if i == 0 else None  # the first result stays referenced
                    assert (y == 6 + 4 * i).all()
                assert (kept[0] == 6).all()
                runtime.finish(rank)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=peer, args=(rank,)) for rank in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    assert pool.reused - before >= 8


def test_coalesced_buckets_come_from_the_pool_and_stay_while_their_results_live() -> None:
    """One peer, all_reduce_coalesced of arrays past the threshold in a loop: the bucket's memory is
    recycled once the last results are dropped, never while they are held."""
    with Runtime() as runtime:
        runtime.register(0, "cpu", CollectiveConfig(num_devices=1, timeout=30))
        arrays = [np.full(ELEMENTS, 1.0, np.float32), np.full(ELEMENTS // 2, 2.0, np.float32)]
        held = runtime.all_reduce_coalesced(0, arrays)
        before = pool.reused
        for i in range(3):
            results = runtime.all_reduce_coalesced(0, [a + i for a in arrays])
            assert (results[0] == 1 + i).all() and (results[1] == 2 + i).all()
            assert not np.shares_memory(results[0], held[0])  # the held results' bucket is not reused
            del results
        assert (held[0] == 1).all() and (held[1] == 2).all()
        assert pool.reused - before >= 2  # each later call took the bucket the one before dropped


def test_a_full_pool_keeps_no_trace_of_the_sizes_it_could_not_hold() -> None:
    """Each size asked of a pool full of results held added an empty list it scanned ever after."""
    blocks = Pool(2 * MIN_BYTES)
    held = [blocks.empty((ELEMENTS,), np.float32) for _ in range(2)]
    for extra in range(1, 200):
        assert blocks.empty((ELEMENTS + extra,), np.float32).base is None  # past the limit: plain
    assert len(blocks.sizes) == 1, blocks.sizes
    del held
