"""The trivial shared-memory baseline: what a few lines of numpy and a barrier achieve.

all_reduce: barrier; thread t combines slice t of every peer's buffer into a shared result;
barrier; every thread copies the whole result into its own output. reduce: the same, and only
the root copies. broadcast: barrier; every thread copies the root's buffer; barrier.
Correct only for threads of one process with equal arrays; no checks, no errors.

``BareAllReduce``: the least a small all_reduce among threads can do in Python (one wake-up per
waiting peer, nothing else), to show what the interpreter itself costs beside our runtime.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp, chunk_bounds
from collective.arrays import scale_for_mean

__all__ = ["BareAllReduce", "TrivialGroup"]


class TrivialGroup:
    """One group of ``peers`` threads exchanging arrays of ``count`` elements of ``dtype``."""

    def __init__(self, peers: int, count: int, dtype: Any, timeout: float = 600.0) -> None:
        self.peers = peers
        self.barrier = threading.Barrier(peers, timeout=timeout)
        self.inputs: list[Any] = [None] * peers
        self.shared = np.empty(count, dtype)
        self.slices = [slice(lo, hi) for lo, hi in chunk_bounds(count, peers)]

    def all_reduce(self, peer: int, x: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self._combine_slices(peer, x, op)
        np.copyto(out, self.shared)
        if op is ReduceOp.MEAN:
            scale_for_mean(out, self.peers)

    def reduce(self, peer: int, x: np.ndarray, out: np.ndarray | None, op: ReduceOp, root: int) -> None:
        self._combine_slices(peer, x, op)
        if out is not None and peer == root:
            np.copyto(out, self.shared)
            if op is ReduceOp.MEAN:
                scale_for_mean(out, self.peers)

    def broadcast(self, peer: int, x: np.ndarray | None, out: np.ndarray, root: int) -> None:
        self.inputs[peer] = x
        self.barrier.wait()
        np.copyto(out, self.inputs[root])
        self.barrier.wait()

    def _combine_slices(self, peer: int, x: np.ndarray, op: ReduceOp) -> None:
        self.inputs[peer] = x
        self.barrier.wait()  # every input is in place (and the previous call's copies are done)
        mine = self.slices[peer]
        part = self.shared[mine]
        ufunc = getattr(np, op.ufunc_name)
        np.copyto(part, self.inputs[0][mine])
        for other in self.inputs[1:]:
            ufunc(part, other[mine], out=part)
        self.barrier.wait()  # the shared result is complete


class BareAllReduce:
    """The least a small all_reduce among threads can do in Python, for comparison: a counter under
    a lock; the last to arrive sums and releases one lock per waiting peer (no checks, no timeout)."""

    def __init__(self, peers: int) -> None:
        self.peers = peers
        self.lock = threading.Lock()
        self.bells = [threading.Lock() for _ in range(peers)]
        for bell in self.bells:
            bell.acquire()
        self.arrived = 0
        self.inputs: list[Any] = [None] * peers
        self.results: list[Any] = []

    def all_reduce(self, rank: int, x: np.ndarray) -> np.ndarray:
        with self.lock:
            self.inputs[rank] = x
            self.arrived += 1
            last = self.arrived == self.peers
            if last:
                self.arrived = 0
                total = self.inputs[0] + self.inputs[1] if self.peers > 1 else self.inputs[0].copy()
                for other in self.inputs[2:]:
                    total += other
                self.results = [total.copy() for _ in range(self.peers)]
        if last:
            for waiter, bell in enumerate(self.bells):
                if waiter != rank:
                    bell.release()
        else:
            self.bells[rank].acquire()
        result: np.ndarray = self.results[rank]
        return result
