"""The dispatchers' argument checks, made before any message: roots, block sizes, counts.

Each raises InvalidArgumentError naming the collective, the peer, the values and what was
expected, so a caller's mistake fails that call on that peer instead of a schedule exchanging
messages of the wrong sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

from collective.algorithms.link import Link
from collective.algorithms.ops import Array, Blocks, Counts
from collective.errors import InvalidArgumentError

__all__ = ["BlockSizes", "check_blocks", "check_counts", "check_root"]

BlockSizes = Blocks | Sequence[int]
"""Where each peer's block lies: a ``Blocks``, or its sizes (one per peer, in peer order)."""


def check_root(collective: str, link: Link, root: int) -> None:
    """``root`` must be a peer of the group; raises InvalidArgumentError."""
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < link.size:
        raise InvalidArgumentError(
            f"{collective} on peer {link.rank}: root {root!r} is outside the group of {link.size} peers "
            f"(0 .. {link.size - 1})"
        )


def check_blocks(
    collective: str,
    link: Link,
    blocks: BlockSizes | None,
    part: tuple[str, Array],
    whole: tuple[str, Array | None] | None = None,
) -> Blocks | None:
    """``blocks`` as one ``Blocks`` size per peer (None stays None: equal blocks), after checking
    that ``part`` is this peer's block and ``whole`` (where given: the root's, or every peer's
    array of all the blocks) holds every block, of ``part``'s dtype (each block the size of
    ``part`` for equal blocks). Raises InvalidArgumentError."""
    layout = _layout(collective, link, blocks)
    (part_name, part_array), rank = part, link.rank
    if layout is not None and part_array.size != layout.sizes[rank]:
        raise InvalidArgumentError(
            f"{collective} on peer {rank}: {part_name} has {part_array.size} elements; the blocks "
            f"{list(layout.sizes)} give peer {rank} {layout.sizes[rank]}"
        )
    if whole is None:
        return layout
    whole_name, whole_array = whole
    if whole_array is None:
        raise InvalidArgumentError(f"{collective} on peer {rank} (the root) needs {whole_name}, got None")
    if layout is None:
        expected = link.size * part_array.size
        expectation = f"{link.size} peers x {part_array.size} ({part_name}'s size) = {expected}"
    else:
        expected = layout.total
        expectation = f"the blocks' total {expected}"
    if whole_array.size != expected or whole_array.dtype != part_array.dtype:
        raise InvalidArgumentError(
            f"{collective} on peer {rank}: {whole_name} has {whole_array.size} elements of "
            f"{whole_array.dtype}; expected {expectation} elements of {part_array.dtype}"
        )
    return layout


def _layout(collective: str, link: Link, blocks: BlockSizes | None) -> Blocks | None:
    if blocks is None:
        return None
    try:
        layout = blocks if isinstance(blocks, Blocks) else Blocks(blocks)
    except InvalidArgumentError as exc:
        raise InvalidArgumentError(f"{collective} on peer {link.rank}: {exc}") from exc
    if len(layout) != link.size:
        raise InvalidArgumentError(
            f"{collective} on peer {link.rank}: blocks must have one size per peer: got "
            f"{len(layout)} sizes {list(layout.sizes)} for {link.size} peers"
        )
    return layout


def check_counts(link: Link, counts: Counts | None, src: Array, dst: Array) -> Counts | None:
    """all_to_all's sizes: an n x n matrix of sizes >= 0 whose row r is this peer's ``src`` and
    column r its ``dst`` (None: equal blocks, a multiple of n). Returns it as tuples; raises
    InvalidArgumentError."""
    n, r = link.size, link.rank
    if counts is None:
        if src.size % n or src.size != dst.size or src.dtype != dst.dtype:
            raise InvalidArgumentError(
                f"all_to_all on peer {r}: src ({src.size} elements of {src.dtype}) and dst "
                f"({dst.size} of {dst.dtype}) must have the same dtype and size, a multiple of {n} peers"
            )
        return None
    try:
        matrix = tuple(Blocks(row).sizes for row in counts)
    except (InvalidArgumentError, TypeError) as exc:
        raise InvalidArgumentError(
            f"all_to_all on peer {r}: counts must be rows of sizes >= 0, got {counts!r}"
        ) from exc
    if len(matrix) != n or any(len(row) != n for row in matrix):
        raise InvalidArgumentError(
            f"all_to_all on peer {r}: counts must be {n} x {n} (counts[i][j]: the elements peer i "
            f"sends to peer j), got {counts!r}"
        )
    sending, receiving = sum(matrix[r]), sum(row[r] for row in matrix)
    if src.size != sending or dst.size != receiving or src.dtype != dst.dtype:
        raise InvalidArgumentError(
            f"all_to_all on peer {r}: src has {src.size} elements of {src.dtype} and dst {dst.size} of "
            f"{dst.dtype}; counts send {sending} (row {r}) and receive {receiving} (column {r}), "
            f"of one dtype"
        )
    return matrix
