"""Direct calls with torch tensors (collective/tensors.py): tensors in, tensors out, ``out=`` in place.

Thread peers of one process. torch is optional: the tests skip where it is absent (JAX: test_jax.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers

torch = pytest.importorskip("torch")

PEERS = 3
TORCH_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.complex64,
    torch.complex128,
]


def tensor_of(peer: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """Small integers (exact in every dtype): peer's input."""
    count = int(np.prod(shape)) if shape else 1
    return ((torch.arange(count) + peer) % 5).reshape(shape).to(dtype)


def total(shape: tuple[int, ...], dtype: Any) -> Any:
    return sum(tensor_of(p, shape, torch.float64) for p in range(PEERS)).to(dtype)


@pytest.fixture
def rt() -> Any:
    with col.Runtime() as runtime:
        yield runtime


def register(rt: col.Runtime, peer: int) -> None:
    rt.register(peer, "cpu", col.CollectiveConfig(num_devices=PEERS, timeout=20))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_all_reduce_of_every_dtype_returns_a_tensor(rt: col.Runtime, dtype: Any) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        x = tensor_of(peer, (17,), dtype)
        before = x.clone()
        result = rt.all_reduce(peer, x)
        assert torch.equal(x, before)  # the input is never written
        return result

    for result in run_peers(PEERS, body, rt):
        assert isinstance(result, torch.Tensor) and result.dtype == dtype and result.shape == (17,)
        assert torch.equal(result, total((17,), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_out_tensors_are_written_in_place(rt: col.Runtime, dtype: Any) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        x = tensor_of(peer, (4, 3), dtype)
        out = torch.full((4, 3), -1).to(dtype)
        assert rt.all_reduce(peer, x, out=out) is out
        assert torch.equal(out, total((4, 3), dtype))
        assert rt.all_reduce(peer, x, out=x) is x  # out may be x: in place
        assert torch.equal(x, total((4, 3), dtype))
        gathered = torch.empty(PEERS, 2, dtype=dtype)
        assert rt.all_gather(peer, tensor_of(peer, (2,), dtype), out=gathered) is gathered
        assert torch.equal(gathered, torch.stack([tensor_of(p, (2,), dtype) for p in range(PEERS)]))
        received = torch.empty(5, dtype=dtype)
        assert rt.broadcast(peer, tensor_of(1, (5,), dtype) if peer == 1 else None, out=received) is received
        assert torch.equal(received, tensor_of(1, (5,), dtype))

    run_peers(PEERS, body, rt)


def test_out_tensors_are_told_apart_by_their_memory(rt: col.Runtime) -> None:
    """Another tensor over x's very memory is in place; one over part of it is refused on every peer;
    tensors made from overlapping numpy views (distinct storages, shared bytes) are refused too."""

    def body(peer: int) -> list[str]:
        register(rt, peer)
        base = torch.zeros(8)
        base[:4] = tensor_of(peer, (4,), torch.float32)
        same = base[:4].view(4)  # another tensor object, exactly x's memory
        assert rt.all_reduce(peer, base[:4], out=same) is same
        assert torch.equal(base[:4], total((4,), torch.float32))
        errors = []
        for x, out in ((base[:4], base[2:6]), _from_overlapping_numpy()):
            try:
                rt.all_reduce(peer, x, out=out)
            except col.InvalidArgumentError as exc:
                errors.append(str(exc))
        return errors

    for errors in run_peers(PEERS, body, rt):
        assert len(errors) == 2 and all("out overlaps x without being x" in e for e in errors), errors


def _from_overlapping_numpy() -> tuple[Any, Any]:
    memory = np.zeros(8, np.float32)
    return torch.from_numpy(memory[:4]), torch.from_numpy(memory[2:6])


def test_inputs_that_require_grad_are_read_not_recorded(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        weight = tensor_of(peer, (6,), torch.float32).requires_grad_()
        result = rt.all_reduce(peer, weight * 1.0)  # a non-leaf with a grad_fn
        assert not result.requires_grad and result.grad_fn is None
        leaf_result = rt.all_reduce(peer, weight, op="max")
        assert weight.requires_grad and weight.grad is None
        return result, leaf_result

    for result, leaf_result in run_peers(PEERS, body, rt):
        assert torch.equal(result, total((6,), torch.float32))
        assert torch.equal(
            leaf_result, torch.stack([tensor_of(p, (6,), torch.float32) for p in range(PEERS)]).amax(0)
        )


def test_non_contiguous_tensors(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        grid = tensor_of(peer, (5, 4), torch.float32)
        column = rt.all_reduce(peer, grid[:, 2])  # strided
        transposed = rt.all_reduce(peer, grid.t())
        assert torch.equal(grid, tensor_of(peer, (5, 4), torch.float32))
        return column, transposed

    for column, transposed in run_peers(PEERS, body, rt):
        assert torch.equal(column, total((5, 4), torch.float32)[:, 2])
        assert torch.equal(transposed, total((5, 4), torch.float32).t())


def test_numpy_and_torch_peers_mix_and_each_gets_its_own_kind(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        x = tensor_of(peer, (3, 2), torch.float32)
        mine = x.numpy() if peer % 2 == 0 else x
        return rt.all_reduce(peer, mine), rt.reduce_scatter(peer, mine.reshape(6), op="max")

    largest = torch.stack([tensor_of(p, (6,), torch.float32) for p in range(PEERS)]).amax(0)
    for peer, (summed, scattered) in enumerate(run_peers(PEERS, body, rt)):
        kind = np.ndarray if peer % 2 == 0 else torch.Tensor
        assert isinstance(summed, kind) and isinstance(scattered, kind)
        np.testing.assert_array_equal(np.asarray(summed), total((3, 2), torch.float32).numpy())
        np.testing.assert_array_equal(np.asarray(scattered), largest[2 * peer : 2 * peer + 2].numpy())


def test_bfloat16_travels_bit_for_bit(rt: col.Runtime) -> None:
    values = torch.tensor([1.0078125, -3.140625, 65280.0, 1e-38], dtype=torch.bfloat16)

    def body(peer: int) -> Any:
        register(rt, peer)
        if peer == 0:
            rt.broadcast(peer, values)
            return rt.broadcast(peer, values)
        received = rt.broadcast(peer, None, out=torch.empty(4, dtype=torch.bfloat16))  # no x: out says torch
        unlabelled = rt.broadcast(peer, None)  # neither x nor out: a numpy (ml_dtypes) array
        assert unlabelled.dtype.name == "bfloat16"
        assert (unlabelled.view(np.int16) == values.view(torch.int16).numpy()).all()
        return received

    for result in run_peers(PEERS, body, rt):
        assert result.dtype == torch.bfloat16
        assert torch.equal(result.view(torch.int16), values.view(torch.int16))


def test_module_level_functions_take_tensors() -> None:
    config = col.CollectiveConfig(num_devices=2, timeout=20)

    def body(peer: int) -> Any:
        col.register(peer, "cpu", config)
        result = col.all_reduce(peer, torch.full((2,), float(peer + 1)), op="mean")
        col.finish(peer)
        return result

    for result in run_peers(2, body):
        assert torch.equal(result, torch.full((2,), 1.5))


def test_tensor_calls_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from collective.bench import tensor_calls

    assert tensor_calls.main(["--peers", "2", "--rounds", "1", "--calls", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["peers", "numpy", "torch", "extra", "numpy", "out=", "torch", "out=", "extra"]
    assert lines[2].split()[0] == "2" and len(lines[2].split()) == 7


UNREADABLE = {
    "meta": lambda: torch.empty(4, device="meta"),
    "sparse": lambda: torch.ones(4).to_sparse(),
    "float8": lambda: torch.ones(4).to(torch.float8_e4m3fn),
}


@pytest.mark.parametrize("kind", UNREADABLE, ids=list(UNREADABLE))
def test_a_tensor_that_cannot_be_read_fails_every_peer_and_keeps_the_job_in_step(
    rt: col.Runtime, kind: str
) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        x = UNREADABLE[kind]() if peer == 0 else torch.ones(4)
        try:
            rt.all_reduce(peer, x)
        except col.InvalidArgumentError as exc:
            first = str(exc)
        else:
            first = "no error"
        out = UNREADABLE[kind]() if peer == 1 else None
        try:
            rt.all_reduce_coalesced(peer, [torch.ones(4)], out=None if out is None else [out])
        except col.InvalidArgumentError as exc:
            second = str(exc)
        else:
            second = "no error"
        return first, second, rt.all_reduce(peer, torch.full((4,), peer + 1.0))

    for first, second, after in run_peers(PEERS, body, rt):
        assert "peer 0: x: a torch tensor" in first and "cannot be read as an array" in first, first
        assert "peer 1: out[0]: a torch tensor" in second, second  # (its out list, by index)
        torch.testing.assert_close(after, torch.full((4,), 6.0))  # the next call pairs with its own


class UserTensor(torch.Tensor):
    """A subclass of torch.Tensor defined outside torch (as libraries and users do)."""


def test_tensor_subclasses_from_any_module_are_tensors(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        register(rt, peer)
        plain = torch.full((3,), peer + 1.0).as_subclass(UserTensor)
        graded = torch.full((3,), 1.0, requires_grad=True).as_subclass(UserTensor)
        bf16 = torch.full((3,), 2.0, dtype=torch.bfloat16).as_subclass(UserTensor)
        return rt.all_reduce(peer, plain), rt.all_reduce(peer, graded), rt.all_reduce(peer, bf16)

    for plain, graded, bf16 in run_peers(PEERS, body, rt):
        assert isinstance(plain, torch.Tensor) and isinstance(bf16, torch.Tensor)
        torch.testing.assert_close(plain, torch.full((3,), 6.0))
        torch.testing.assert_close(graded.detach(), torch.full((3,), 3.0))
        assert bf16.dtype == torch.bfloat16 and bf16.tolist() == [6.0] * 3


def test_an_out_that_is_a_conjugate_or_negative_view_is_refused_on_every_peer(rt: col.Runtime) -> None:
    """Such a view reads as a resolved copy: the result went into the copy and out stayed as it was."""

    def body(peer: int) -> Any:
        register(rt, peer)
        plain = torch.zeros(4, dtype=torch.complex64)
        for out in (torch._neg_view(torch.zeros(4)), plain.conj()):
            x = torch.ones(4, dtype=out.dtype)
            with pytest.raises(col.InvalidArgumentError, match="conjugate or negative view"):
                rt.all_reduce(peer, x, out=out)
        return rt.all_reduce(peer, torch.ones(2), out=torch.zeros(2))

    for result in run_peers(PEERS, body, rt):
        assert torch.equal(result, torch.full((2,), float(PEERS)))
