"""``dist.all_to_all_single`` / ``dist.all_to_all`` of the "collective" backend: our all_to_all.

Even splits are one all_to_all of the tensor's blocks. Uneven ones (split sizes, or lists of
tensors of different sizes) first check the splits (every rank sends what its receiver expects:
one small all_to_all and one small all_reduce, a mismatch an error on every rank), then move the
blocks padded to the largest one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.calls import AllToAll as AllToAllCall
from collective.errors import InvalidArgumentError
from collective.groups import Group
from collective.runtime import Runtime
from collective.torch.checks import invalid, on_every_rank
from collective.torch.work import TorchWork, array, fill, host, store_back

dist: Any = importlib.import_module("torch.distributed")

__all__ = ["AllToAll"]


class AllToAll:
    """all_to_all between this process's peer and the group's other ranks."""

    runtime: Runtime
    peer: int
    group: Group | None
    members: tuple[int, ...]
    launch: Callable[..., TorchWork]
    _kw: Callable[[Any], dict[str, Any]]

    @on_every_rank(AllToAllCall)
    def all_to_all_single(
        self,
        output: Any,
        input: Any,
        output_splits: Sequence[int],
        input_splits: Sequence[int],
        opts: Any = None,
    ) -> TorchWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        size, kw = len(self.members), self._kw(opts)
        even = not output_splits and not input_splits
        if even and (input.shape != output.shape or (input.dim() and input.shape[0] % size)):
            raise invalid(
                f"all_to_all_single: input {tuple(input.shape)} and output {tuple(output.shape)} must have "
                f"one shape whose first dimension divides by {size} (or pass split sizes)"
            )
        for name, splits, tensor in (("input", input_splits, input), ("output", output_splits, output)):
            rows = tensor.shape[0] if tensor.dim() else 1
            if splits and (len(splits) != size or any(s < 0 for s in splits) or sum(splits) != rows):
                raise invalid(
                    f"all_to_all_single: {name}_split_sizes {list(splits)} must be {size} sizes >= 0 adding "
                    f"up to the {name}'s first dimension, {rows}"
                )
            if not even and not splits and rows % size:
                raise invalid(
                    f"all_to_all_single: without {name}_split_sizes the {name}'s first dimension ({rows}) "
                    f"must divide by {size}"
                )

        def body() -> None:
            buffer = host(output)
            source, out = array(host(input)), array(buffer)
            if even:
                self.runtime.all_to_all(self.peer, source.reshape(size, -1), out=out.reshape(size, -1), **kw)
            else:
                sent = list(input_splits) or [source.shape[0] // size] * size
                expected = list(output_splits) or [out.shape[0] // size] * size
                blocks = np.split(source, np.cumsum(sent)[:-1]) if source.ndim else [source]
                np.concatenate(self._uneven(blocks, expected, kw), out=out.reshape(-1, *out.shape[1:]))
            store_back(buffer, output)

        return self.launch("all_to_all_single", body, [output], opts)

    alltoall_base = all_to_all_single

    @on_every_rank(AllToAllCall)
    def alltoall(self, outputs: Sequence[Any], inputs: Sequence[Any], opts: Any = None) -> TorchWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        outputs, inputs, kw = list(outputs), list(inputs), self._kw(opts)
        if len(outputs) != len(self.members) or len(inputs) != len(self.members):
            raise invalid(f"all_to_all takes {len(self.members)} input and output tensors each")

        def body() -> None:
            flat = [array(host(t)).reshape(-1) for t in inputs]
            blocks = self._uneven(flat, [t.numel() for t in outputs], kw)
            for block, target in zip(blocks, outputs, strict=True):
                fill(target, block)

        return self.launch("all_to_all", body, outputs, opts)

    def _uneven(self, blocks: Sequence[Any], expected: Sequence[int], kw: dict[str, Any]) -> list[Any]:
        """Block j of ``blocks`` to rank j; the blocks received (``expected[j]`` rows from rank j).

        Two small collectives check the splits (every rank sends what its receiver expects) and agree
        on the largest block; the all_to_all moves blocks padded to it.
        """
        size = len(self.members)
        if len(blocks) != size or len(expected) != size:
            raise InvalidArgumentError(
                f"all_to_all: the splits name {len(blocks)} and {len(expected)} ranks, not {size}"
            )
        rest, dtype = tuple(blocks[0].shape[1:]), blocks[0].dtype
        sent = np.array([[b.shape[0]] for b in blocks], np.int64)
        coming = self.runtime.all_to_all(self.peer, sent, **kw).reshape(-1)  # what each rank sends me
        wrong = [j for j in range(size) if coming[j] != expected[j]]
        local = max([*(b.shape[0] for b in blocks), *expected, 0])
        agreed = self.runtime.all_reduce(self.peer, np.array([local, len(wrong)], np.int64), "max", **kw)
        if agreed[1]:  # every rank stops here together
            mine = "; ".join(f"rank {j} sends {coming[j]} rows where I expect {expected[j]}" for j in wrong)
            raise InvalidArgumentError(
                f"all_to_all: the split sizes of the ranks do not match ({mine or 'on another rank'}): "
                f"rank i's output_split_sizes[j] must be rank j's input_split_sizes[i]"
            )
        largest = int(agreed[0])
        padded = np.zeros((size, largest, *rest), dtype=dtype)
        for j, block in enumerate(blocks):
            padded[j, : block.shape[0]] = block
        received = self.runtime.all_to_all(self.peer, padded, **kw)
        return [received[j, :rows] for j, rows in enumerate(expected)]
