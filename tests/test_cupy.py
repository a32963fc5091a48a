"""CuPy arrays through the same code path; skipped where CuPy or a CUDA device is missing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers

cupy = pytest.importorskip("cupy")
try:
    DEVICES = cupy.cuda.runtime.getDeviceCount()
except Exception:  # no driver
    DEVICES = 0
pytestmark = pytest.mark.skipif(DEVICES == 0, reason="no CUDA device")


@pytest.mark.parametrize("strategy", ["centralized", "tree:2", "ring"])
@pytest.mark.parametrize("fuse_below", [0, 64 * 1024])
def test_cupy_collectives(strategy: str, fuse_below: int) -> None:
    n = 3
    config = col.CollectiveConfig(
        num_devices=n,
        local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy,
        local_broadcast_strategy=strategy,
        timeout=30,
    )
    devices = [f"cuda:{p % DEVICES}" for p in range(n)]
    inputs = [np.arange(1001, dtype=np.float32) * (p + 1) for p in range(n)]

    def body(peer: int) -> tuple[Any, ...]:
        with cupy.cuda.Device(peer % DEVICES):
            rt.register(peer, devices[peer], config)
            x = cupy.asarray(inputs[peer])
            y = rt.all_reduce(peer, x, "sum")
            r = rt.reduce(peer, x, "max", root=1)
            b = rt.broadcast(peer, x if peer == 2 else None)
            rt.finish(peer)
            assert isinstance(y, cupy.ndarray) and y.device.id == peer % DEVICES
            return cupy.asnumpy(y), None if r is None else cupy.asnumpy(r), cupy.asnumpy(b)

    with col.Runtime(fuse_below=fuse_below) as rt:
        results = run_peers(n, body, rt)
    for y, _, b in results:
        np.testing.assert_allclose(y, sum(inputs))
        np.testing.assert_array_equal(b, inputs[2])
    np.testing.assert_array_equal(results[1][1], inputs[2])


def test_array_on_the_wrong_device_is_an_invalid_argument() -> None:
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        with pytest.raises(
            col.InvalidArgumentError, match="x is on cuda:0 but the peer was registered on cpu"
        ):
            rt.all_reduce(0, cupy.ones(3))
