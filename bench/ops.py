"""What the benchmark knows of each op: sizes, inputs, expected results, bus factor, and the calls.

Sizes follow nccl-tests: ``size`` is the op's full buffer (all_gather's output, reduce_scatter's
input, all_to_all's buffer, gather's output at the root, scatter's input at the root, one
message of sendrecv). Inputs are small integers (exact in every dtype), piecewise constant per
block, and alternate between two value sets from one iteration to the next; results are checked
block by block against values computed in the same dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from collective.algorithms.ops import ReduceOp
from collective.arrays import scale_for_mean

__all__ = [
    "OPS",
    "REDUCING",
    "ROOTED",
    "TRIVIAL_OPS",
    "OpBench",
    "Shapes",
    "busbw_factor",
    "input_value",
    "shapes",
]


def input_value(peer: int, parity: int) -> int:
    """Every element of ``peer``'s input (block 0) on iterations of this parity."""
    return peer + 1 + parity


@dataclass(frozen=True)
class Shapes:
    """Element counts: each peer's input, the result (where a peer gets one), and blocks per buffer."""

    input: int
    result: int
    blocks: int  # the input's blocks (1 unless the op routes blocks)


def busbw_factor(op: str, peers: int) -> float:
    """nccl-tests' bus bandwidth factors."""
    if op in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (peers - 1) / peers
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (peers - 1) / peers
    return 0.0 if op == "barrier" else 1.0


def shapes(op: str, count: int, peers: int) -> Shapes:
    """The element counts of ``op`` whose full buffer holds ``count`` elements (rounded to blocks)."""
    k = count // peers
    return {
        "all_gather": Shapes(k, k * peers, 1),
        "gather": Shapes(k, k * peers, 1),
        "reduce_scatter": Shapes(k * peers, k, peers),
        "all_to_all": Shapes(k * peers, k * peers, peers),
        "scatter": Shapes(k * peers, k, peers),
        "barrier": Shapes(0, 0, 1),
    }.get(op, Shapes(count, count, 1))


def moved_bytes(op: str, size: int, peers: int, itemsize: int) -> int:
    """``size`` bytes as ``op`` moves them: an op that splits its buffer into one block per peer
    moves whole elements per block, at least one (nccl-tests rounds its sizes the same way)."""
    counts = shapes(op, size // itemsize, peers)
    if counts.blocks == 1 and op not in ("all_gather", "gather"):
        return size - size % itemsize
    return max(1, size // itemsize // peers) * peers * itemsize


def make_input(op: str, peer: int, parity: int, counts: Shapes, dtype: Any) -> np.ndarray:
    """Peer ``peer``'s input: block j holds input_value(peer) + j."""
    blocks = np.arange(counts.blocks, dtype=np.int64) + input_value(peer, parity)
    per = counts.input // counts.blocks if counts.blocks else 0
    return np.repeat(blocks, per).astype(dtype)


def _reduced(values: list[int], redop: str, dtype: Any) -> Any:
    op = ReduceOp.parse(redop)
    acc = np.full(1, values[0], dtype)
    for value in values[1:]:
        getattr(np, op.ufunc_name)(acc, np.full(1, value, dtype), out=acc)
    if op is ReduceOp.MEAN:
        scale_for_mean(acc, len(values))
    return acc[0]


def expected_blocks(
    op: str, peer: int, peers: int, root: int, redop: str, parity: int, dtype: Any
) -> np.ndarray | None:
    """The value of each block of ``peer``'s result (None where it gets no result)."""
    everyone = [input_value(p, parity) for p in range(peers)]
    if op in ("all_reduce", "reduce", "all_reduce_coalesced"):
        if op == "reduce" and peer != root:
            return None
        return np.array([_reduced(everyone, redop, dtype)], dtype)
    if op == "broadcast":
        return np.array([everyone[root]], dtype)
    if op in ("all_gather", "gather"):
        return None if op == "gather" and peer != root else np.array(everyone, dtype)
    if op == "reduce_scatter":
        return np.array([_reduced([v + peer for v in everyone], redop, dtype)], dtype)
    if op == "all_to_all":
        return np.array([v + peer for v in everyone], dtype)
    if op == "scatter":
        return np.array([everyone[root] + peer], dtype)
    if op == "sendrecv":
        return np.array([everyone[(peer - 1) % peers]], dtype)
    return np.zeros(0, dtype)  # barrier


def count_wrong(result: Any, blocks: np.ndarray | None, count: int) -> int:
    """Wrong elements of a flat ``result`` of ``count`` elements against per-block values."""
    if blocks is None:
        return 0 if result is None else count
    if result is None:
        return count
    flat = np.asarray(result).reshape(-1)
    if flat.size != count:
        return count
    if not count:
        return 0
    return int(np.count_nonzero(flat.reshape(blocks.size, -1) != blocks[:, None]))


Call = Callable[..., Any]


@dataclass(frozen=True)
class OpBench:
    """How our runtime runs one iteration of ``op`` for ``peer`` (a flat result, or None)."""

    op: str

    def run(self, runtime: Any, peer: int, x: Any, out: Any, peers: int, root: int, redop: str) -> Any:
        op = self.op
        if op == "all_reduce":
            return runtime.all_reduce(peer, x, redop, out=out)
        if op == "reduce":
            return runtime.reduce(peer, x, redop, root, out=out if peer == root else None)
        if op == "broadcast":
            return runtime.broadcast(peer, x if peer == root else None, out=out)
        if op == "all_gather":
            return runtime.all_gather(peer, x, out=None if out is None else out.reshape(peers, -1))
        if op == "gather":
            target = None if out is None or peer != root else out.reshape(peers, -1)
            return runtime.gather(peer, x, root, out=target)
        if op == "reduce_scatter":
            return runtime.reduce_scatter(peer, x, redop, out=out)
        if op == "all_to_all":
            return runtime.all_to_all(peer, x, out=out)
        if op == "scatter":
            source = x.reshape(peers, -1) if peer == root else None
            return runtime.scatter(peer, source, root, out=out)
        if op == "sendrecv":
            runtime.send(peer, x, (peer + 1) % peers)
            return runtime.recv(peer, (peer - 1) % peers, out=out)
        if op == "all_reduce_coalesced":
            pieces = np.array_split(x, min(26, max(1, x.size)))
            outs = None if out is None else np.array_split(out, len(pieces))
            results = runtime.all_reduce_coalesced(peer, pieces, redop, out=outs)
            return out if out is not None else np.concatenate([r.reshape(-1) for r in results])
        runtime.barrier(peer)
        return np.zeros(0, x.dtype)


OPS = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "sendrecv",
    "barrier",
    "all_reduce_coalesced",
)
TRIVIAL_OPS = ("all_reduce", "reduce", "broadcast")  # the trivial baseline's
ROOTED = ("reduce", "broadcast", "gather", "scatter")
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "all_reduce_coalesced")
