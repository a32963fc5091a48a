"""Checking a peer's arrays and turning them into the flat buffers the algorithms work on.

A peer is registered on a device: ``"cpu"`` (numpy arrays) or ``"cuda:N"`` (CuPy arrays on GPU N).
Supported dtypes: float16/32/64, int8..int64, uint8..uint64, complex64/128 (sum, mean, prod
only) and bfloat16 (from ml_dtypes). The input is never written; a non-contiguous input is
copied once into a contiguous buffer, a contiguous one is used as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    from numpy.lib.array_utils import byte_bounds
except ImportError:  # numpy 1
    from numpy import byte_bounds  # type: ignore[attr-defined,no-redef]

from collective.algorithms.ops import BITWISE, Array, ReduceOp, array_module
from collective.errors import InvalidArgumentError, RegistrationError
from collective.pool import pool

__all__ = [
    "CPU",
    "Device",
    "as_array",
    "check_array",
    "check_out",
    "dtype_problem",
    "flat",
    "integer",
    "new_result",
    "placement",
    "same_memory",
    "scale_for_mean",
    "timeout_seconds",
]

_ORDERED_KINDS = frozenset("iuf")


def integer(value: Any) -> int | None:
    """``value`` as an int when it is one (a Python or numpy integer, never a bool), else None: peer
    ids, roots and tags computed with numpy are accepted as they are."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        return None
    return int(value)


def real(value: Any) -> float | None:
    """``value`` as a float when it is a real number (Python's or numpy's, never a bool), else None:
    timeouts computed with numpy are accepted as they are."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | float | np.integer | np.floating):
        return None
    return float(value)


def timeout_seconds(timeout: Any) -> float:
    """A call's ``timeout`` as seconds: a finite real number > 0, else InvalidArgumentError."""
    value = real(timeout)
    if value is None or not 0 < value < math.inf:
        raise InvalidArgumentError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    return value


@dataclass(frozen=True)
class Device:
    """Where a peer's arrays live: kind "cpu" or "cuda", and the CUDA device index."""

    kind: str
    index: int = 0

    @classmethod
    def parse(cls, value: Device | str | int) -> Device:
        """ "cpu", "cuda", "cuda:N", an int N (CUDA device N) or a Device; raises RegistrationError.

        A CUDA device must exist: CuPy importable and N below the number of devices CUDA reports.
        """
        device: Device | None = None
        if isinstance(value, Device):
            device = value
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            device = cls("cuda", value)
        elif isinstance(value, str):
            text = value.strip().lower()
            kind, _, index = text.partition(":")
            if text == "cpu":
                device = CPU
            elif kind == "cuda" and (index == "" or index.isdigit()):
                device = cls("cuda", int(index or 0))
        if device is None or device.kind not in ("cpu", "cuda"):
            raise RegistrationError(f"unknown device {value!r}: use 'cpu' or 'cuda:N'")
        if device.kind == "cuda":
            _check_cuda(value, device.index)
        return device

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"

    def empty(self, shape: tuple[int, ...], dtype: Any) -> Array:
        """An uninitialised array on this device (a large numpy one recycled: collective.pool)."""
        if self.kind == "cpu":
            return pool.empty(shape, dtype)
        import cupy

        with cupy.cuda.Device(self.index):
            return cupy.empty(shape, dtype)

    def adopt(self, array: Array) -> Array:
        """``array`` on this device (a copy only when it lives elsewhere)."""
        if self.kind == "cpu":
            return array if isinstance(array, np.ndarray) else array.get()
        import cupy

        with cupy.cuda.Device(self.index):
            return cupy.asarray(array)


CPU = Device("cpu")


def _check_cuda(value: Any, index: int) -> None:
    """RegistrationError unless CuPy can be imported and CUDA device ``index`` exists."""
    try:
        import cupy
    except ImportError as exc:
        raise RegistrationError(
            f"device {value!r} needs CuPy, which cannot be imported here ({exc}): install it "
            f"(pip install cupy-cuda12x, or this project's extra: pip install '.[cuda]') or register on 'cpu'"
        ) from exc
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        raise RegistrationError(f"device {value!r}: CUDA reports no usable device ({exc})") from exc
    if index >= count:
        raise RegistrationError(
            f"device {value!r}: this machine has {count} CUDA device{'s' if count != 1 else ''}"
            + (f" (cuda:0 .. cuda:{count - 1})" if count else "")
        )


def _device_of(array: Array) -> Device:
    if isinstance(array, np.ndarray):
        return Device("cpu")
    return Device("cuda", int(array.device.id))


def dtype_problem(dtype: np.dtype[Any], op: ReduceOp | None) -> str | None:
    if dtype.kind in "fc" and dtype.itemsize > (8 if dtype.kind == "f" else 16):
        return (
            f"unsupported dtype {dtype.name} (long double): its layout differs between platforms; "
            f"use {'float64' if dtype.kind == 'f' else 'complex128'}"
        )
    if op in BITWISE and dtype.kind not in "iu":
        return f"op {op.value} (bitwise) takes integer dtypes, not {dtype.name}"
    if dtype.kind in _ORDERED_KINDS or (dtype.kind == "V" and dtype.name == "bfloat16"):
        return None
    if dtype.kind == "c":
        if op in (ReduceOp.MAX, ReduceOp.MIN):
            return f"op {op.value} is not defined for {dtype.name}"
        return None
    return f"unsupported dtype {dtype.name}: use a float, int, uint, complex or bfloat16 dtype"


def as_array(value: Any) -> Any:
    """numpy scalars (``np.float32(1)``) become 0-d arrays; anything else is returned as it is."""
    return np.asarray(value) if isinstance(value, np.generic) else value


def check_array(array: Any, device: Device, op: ReduceOp | None, name: str = "x") -> str | None:
    """Why ``array`` cannot be used by a peer on ``device`` with ``op``, or None if it can."""
    if type(array) is np.ndarray and device.kind == "cpu" and op not in BITWISE:
        dtype = array.dtype
        if dtype.kind in _ORDERED_KINDS and dtype.itemsize <= 8:
            return None  # the common case, decided without building a Device
    try:
        array_module(array)
    except InvalidArgumentError:
        return (
            f"{name} must be an array (numpy, CuPy, torch, JAX, or anything with __array_interface__ "
            f"or __dlpack__), got {type(array).__name__}"
        )
    if _device_of(array) != device:
        return f"{name} is on {_device_of(array)} but the peer was registered on {device}"
    return dtype_problem(array.dtype, op)


def check_out(
    out: Any, device: Device, shape: tuple[int, ...], dtype: Any, source: Array | None
) -> str | None:
    """Why ``out`` cannot receive a result of ``shape``/``dtype``, or None if it can.

    ``out`` may be ``source`` itself (an in-place collective) but may not partly overlap it.
    """
    problem = check_array(out, device, None, name="out")
    if problem:
        return problem
    if out.shape != shape or out.dtype != dtype:
        return (
            f"out has shape {out.shape} and dtype {out.dtype}; the result has {shape} and {np.dtype(dtype)}"
        )
    flags = out.flags
    if not flags.c_contiguous or not flags.writeable:
        return "out must be a writeable C-contiguous array"
    if source is not None and source is not out and _may_overlap(out, source):
        return "out overlaps x without being x: pass out=x for an in-place collective, or a separate array"
    return None


def overlaps_itself(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether two elements of an array of ``shape`` and ``strides`` (bytes, or elements with
    ``itemsize`` 1) may share memory (an expanded view, a stride-tricks window): writing such an
    array loses values. Exact for every layout slicing and transposing make; conservative beyond."""
    if 0 in shape:
        return False  # no element at all
    span = itemsize  # bytes the dimensions looked at so far reach, from an element's start
    for stride, size in sorted((abs(stride), size) for stride, size in zip(strides, shape, strict=True)):
        if size > 1:
            if stride < span:
                return True
            span += stride * (size - 1)
    return False


def _owner(array: Array) -> Any:
    """The object at the end of ``array``'s chain of bases (the array itself if it owns its memory)."""
    while array.base is not None:
        array = array.base
        if not isinstance(array, np.ndarray):
            break
    return array


def _distinct_owners(a: Array, b: Array) -> bool:
    """Whether ``a`` and ``b`` certainly share no byte, decided from what owns their memory: two
    different numpy arrays that own theirs, or two torch storages (the owners of torch tensors'
    numpy views) whose byte ranges do not meet."""
    owner_a, owner_b = _owner(a), _owner(b)
    if owner_a is owner_b:
        return False
    if isinstance(owner_a, np.ndarray) and isinstance(owner_b, np.ndarray):
        return bool(owner_a.flags.owndata and owner_b.flags.owndata)  # else memory from elsewhere
    extent_a, extent_b = _storage_extent(owner_a), _storage_extent(owner_b)
    return (
        extent_a is not None
        and extent_b is not None
        and (extent_a[1] <= extent_b[0] or extent_b[1] <= extent_a[0])
    )


def _storage_extent(owner: Any) -> tuple[int, int] | None:
    """The bytes [start, end) of a torch tensor's storage (None for anything else)."""
    if type(owner).__module__.partition(".")[0] != "torch":
        return None
    try:
        storage = owner.untyped_storage()
        start = int(storage.data_ptr())
        return start, start + int(storage.nbytes())
    except (AttributeError, RuntimeError, TypeError):
        return None


def same_memory(a: Any, b: Any) -> bool:
    """Whether two native arrays are views of exactly the same memory (same start, shape, strides)."""
    if a is b:
        return True
    if a is None or b is None or type(a) is not type(b):
        return False
    try:
        if a.shape != b.shape or a.strides != b.strides or a.dtype != b.dtype:
            return False
        if isinstance(a, np.ndarray):
            if _distinct_owners(a, b):  # no need to read their addresses (~1 us each)
                return False
            return bool(a.__array_interface__["data"][0] == b.__array_interface__["data"][0])
        return bool(a.data.ptr == b.data.ptr)
    except (AttributeError, TypeError):
        return False


def placement(out: Any, x: Any) -> str:
    """Where ``out`` lies against ``x``: "same" (exactly x's memory: in place), "apart" (no byte in
    common) or "overlap" (partly). Decided once per call, from what owns the memory where it can.
    Anything that is no array is "apart": the checks name it."""
    if out is x:
        return "same"
    try:
        if _distinct_owners(out, x):
            return "apart"
        if same_memory(out, x):
            return "same"
        return "overlap" if _may_overlap(out, x) else "apart"
    except (AttributeError, TypeError, InvalidArgumentError):
        return "apart"


def _may_overlap(a: Array, b: Array) -> bool:
    """Whether two arrays may share memory.

    Views of two different numpy arrays that own their memory cannot overlap: that is decided
    from the chain of bases without numpy's overlap solver, which releases the GIL and so costs
    a thread switch on every call (measured: +30 us per small collective with 4 peers).
    """
    if _distinct_owners(a, b):
        return False
    if type(a) is np.ndarray and type(b) is np.ndarray:  # e.g. views of two torch tensors
        low_a, high_a = byte_bounds(a)
        low_b, high_b = byte_bounds(b)
        if high_a <= low_b or high_b <= low_a:
            return False
    return bool(array_module(a).may_share_memory(a, b))


def flat(array: Array) -> Array:
    """A flat C-contiguous view of ``array`` (a copy only when it is not contiguous)."""
    if type(array) is np.ndarray:
        return array.ravel()  # numpy's ravel copies exactly when no contiguous view exists
    xp = array_module(array)
    return xp.ascontiguousarray(array).reshape(-1)


def new_result(device: Device, shape: tuple[int, ...], dtype: Any, out: Array | None) -> Array:
    """The array the result goes to: ``out`` if given, else a new one on ``device``."""
    return out if out is not None else device.empty(shape, dtype)


def scale_for_mean(result: Array, world: int) -> None:
    """Turn a sum into a mean in place: true division for inexact dtypes, floor division for integers."""
    xp = array_module(result)
    if result.dtype.kind in "iu":
        xp.floor_divide(result, world, out=result)
    else:
        xp.true_divide(result, result.dtype.type(world), out=result)
