"""``dist.all_to_all_single`` / ``dist.all_to_all`` of the "collective" backend: our all_to_all.

Even splits are one all_to_all of the tensor's blocks. Uneven ones (split sizes, or lists of
tensors of different sizes) are one all_to_all_v: what each rank sends travels with its call, and
what each rank expects (its output splits) is checked against it on every rank before any data
moves, so a mismatch is an error on every rank; no block is padded.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from collective.calls import AllToAll as AllToAllCall
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
                rows, into = (
                    (source, out) if source.ndim else (source.reshape(1), out.reshape(1))
                )  # (0-d: a row)
                self.runtime.all_to_all_v(self.peer, rows, sent, recv_sizes=expected, out=into, **kw)
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
            flat = np.concatenate([array(host(t)).reshape(-1) for t in inputs])
            sent, expected = [t.numel() for t in inputs], [t.numel() for t in outputs]
            blocks = self.runtime.all_to_all_v(self.peer, flat, sent, recv_sizes=expected, **kw)
            for block, target in zip(blocks, outputs, strict=True):
                fill(target, block.reshape(target.shape))

        return self.launch("all_to_all", body, outputs, opts)
