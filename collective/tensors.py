"""Any framework's arrays in, the caller's kind out: numpy, CuPy, torch, JAX, DLPack, array interfaces.

The runtime works on numpy arrays (CPU) and CuPy arrays (GPU). ``native`` turns what a caller
passes into one of those without copying where the memory allows, and returns how to turn a
result back into the caller's kind:

* numpy arrays as they are; numpy scalars as 0-d arrays;
* CuPy arrays as they are;
* torch tensors: CPU ones as numpy views of their memory (detached: a tensor that requires grad
  is read, never recorded), bfloat16 reinterpreted bit for bit (numpy has no bfloat16: ml_dtypes'
  is used); CUDA ones as CuPy arrays through DLPack. Results come back as tensors on the same
  device, sharing the result's memory;
* JAX arrays (immutable) are read through numpy; results come back as new JAX arrays;
* anything else with ``__cuda_array_interface__`` (CuPy), ``__array_interface__`` or ``__dlpack__``
  (numpy) is viewed in place; its results come back as numpy or CuPy arrays.

``out`` may be any writable tensor of the result's shape and dtype: the result is written into
its memory and the very object is returned. An ``out`` that is exactly ``x``'s memory is in place.
A torch tensor that cannot be read as an array (on the meta device, sparse, a float8 dtype, ...)
is an InvalidArgumentError.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from collective.errors import InvalidArgumentError

__all__ = ["Back", "identity", "native", "writable"]

Back = Callable[[Any], Any]


def identity(array: Any) -> Any:
    return array


def _module(value: Any) -> str:
    return type(value).__module__.split(".")[0]


def native(value: Any) -> tuple[Any, Back]:
    """(the numpy/CuPy array viewing ``value``, how to turn a result back into ``value``'s kind).

    Values that are no array of any kind come back as they are (the checks name them).
    """
    kind = type(value)
    if kind is np.ndarray or value is None:
        return value, identity
    if kind in _TORCH_TENSORS:  # checked first: a training loop passes the same kinds on every call
        return _from_torch(value)
    if isinstance(value, np.generic):
        return np.asarray(value), identity
    if isinstance(value, np.ndarray):  # a subclass: memmap, matrix, recarray, ... read as an ndarray
        if isinstance(value, np.ma.MaskedArray):
            raise InvalidArgumentError(
                "a masked array's mask would be ignored: pass x.filled(value) or x.data for its values"
            )
        return np.asarray(value), identity
    module = _module(value)
    if module == "cupy":
        return value, identity
    torch = sys.modules.get("torch")  # (a subclass of torch.Tensor may live in any module)
    if module == "torch" or (torch is not None and isinstance(value, torch.Tensor)):
        return _from_torch(value)
    if module in ("jax", "jaxlib"):
        devices = value.devices() if callable(getattr(value, "devices", None)) else set()
        return np.asarray(value), _ToJax(next(iter(devices)) if len(devices) == 1 else None)
    if hasattr(value, "__cuda_array_interface__"):
        import cupy

        return cupy.asarray(value), identity
    if hasattr(value, "__array_interface__"):
        return np.asarray(value), identity
    if hasattr(value, "__dlpack__"):
        return np.from_dlpack(value), identity
    return value, identity


def writable(value: Any) -> Any:
    """The array viewing ``value`` as an ``out=`` buffer (InvalidArgumentError for what only reads
    as a copy: writes would be lost)."""
    if value is None or type(value) is np.ndarray:  # (every call passes one)
        return value
    if isinstance(value, np.generic):
        raise InvalidArgumentError(
            "a numpy scalar cannot be written: pass an array (np.empty(()) for a 0-d result)"
        )
    viewed, back = native(value)
    if (back is _to_torch or back is _to_torch_cuda) and (value.is_conj() or value.is_neg()):
        raise InvalidArgumentError(
            "a conjugate or negative view of a torch tensor reads as a copy and cannot be written: "
            "pass out.resolve_conj() (or .resolve_neg()), or a plain tensor"
        )
    if isinstance(back, _ToJax):
        raise InvalidArgumentError(
            "a JAX array is immutable and cannot be written: leave out= unset (the result comes back "
            "as a new jax.Array) or pass a numpy or torch buffer"
        )
    return viewed


class _Torch:
    """What the conversions use of torch, looked up once (the runtime never imports torch itself:
    the first torch tensor it is handed does)."""

    def __init__(self) -> None:
        torch = importlib.import_module("torch")
        self.tensor = torch.Tensor
        self.bfloat16 = torch.bfloat16
        self.int16 = torch.int16
        self.from_numpy = torch.from_numpy


_TORCH_TENSORS: set[type] = set()  # the torch.Tensor classes met so far


@functools.cache
def _torch() -> _Torch:
    return _Torch()  # once, for the first torch tensor


def _from_torch(tensor: Any) -> tuple[Any, Back]:
    torch = _torch()
    if type(tensor) not in _TORCH_TENSORS:
        if not isinstance(tensor, torch.tensor):
            return tensor, identity
        _TORCH_TENSORS.add(type(tensor))
    try:
        return _viewed(tensor, torch)
    except Exception as exc:  # a meta, sparse, nested or quantized tensor, a float8 dtype, ...
        raise InvalidArgumentError(
            f"a torch tensor of {tensor.dtype} on {tensor.device} ({tensor.layout}) cannot be read as an "
            f"array: {exc}; pass a dense CPU or CUDA tensor of a numeric dtype"
        ) from None


def _viewed(tensor: Any, torch: _Torch) -> tuple[Any, Back]:
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    if tensor.is_cuda:
        import cupy

        return cupy.from_dlpack(tensor), _to_torch_cuda
    if tensor.dtype is torch.bfloat16:  # numpy has no bfloat16: view its bits as ml_dtypes'
        import ml_dtypes

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16), _to_torch
    return tensor.numpy(), _to_torch


def _to_torch(array: Any) -> Any:
    torch = _torch()
    if array.dtype.kind == "V":  # ml_dtypes' bfloat16 (dtype.name costs ~2 us in numpy 2)
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _to_torch_cuda(array: Any) -> Any:
    from torch.utils.dlpack import from_dlpack

    return from_dlpack(array)


class _ToJax:
    """A result back to JAX: on the input's device (one device; a sharded input's: the default)."""

    __slots__ = ("device",)

    def __init__(self, device: Any) -> None:
        self.device = device

    def __call__(self, array: Any) -> Any:
        import jax

        return jax.device_put(array, self.device)  # (None: the default device)
