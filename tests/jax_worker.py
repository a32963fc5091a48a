"""Direct calls with JAX arrays, run by tests/test_jax.py in a process of its own: JAX starts
threads at import, and a pytest process that later forks (tests of fork and of dead processes)
could deadlock in the child.

Usage: python tests/jax_worker.py CHECK   (prints "OK CHECK")
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.conftest, run as a script

import collective as col
from tests.conftest import run_peers

PEERS = 3


def pytrees() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", col.CollectiveConfig(num_devices=PEERS, timeout=20))
            grads = {"w": jnp.full((2, 3), peer + 1.0), "b": [jnp.arange(3.0) * peer, jnp.float32(peer)]}
            return jax.tree_util.tree_map(lambda leaf: rt.all_reduce(peer, leaf, op="mean"), grads)

        for mean in run_peers(PEERS, body, rt):
            assert isinstance(mean["w"], jax.Array)
            np.testing.assert_allclose(np.asarray(mean["w"]), np.full((2, 3), 2.0))
            np.testing.assert_allclose(np.asarray(mean["b"][0]), np.arange(3.0))
            np.testing.assert_allclose(np.asarray(mean["b"][1]), 1.0)


def every_collective() -> None:
    """Each collective takes jax.Arrays and gives jax.Arrays back where the peer passed one."""
    with col.Runtime() as rt:

        def body(peer: int) -> dict[str, Any]:
            rt.register(peer, "cpu", col.CollectiveConfig(num_devices=PEERS, timeout=20))
            x = jnp.arange(6.0, dtype=jnp.float32) + peer
            return {
                "all_gather": rt.all_gather(peer, x),
                "reduce_scatter": rt.reduce_scatter(peer, x),
                "all_to_all": rt.all_to_all(peer, x),
                "broadcast": rt.broadcast(peer, x if peer == 0 else None),
                "gather": rt.gather(peer, x, root=1),
                "scatter": rt.scatter(peer, x.reshape(PEERS, 2) if peer == 2 else None, root=2),
                "bfloat16": rt.all_reduce(peer, jnp.ones(3, jnp.bfloat16) * (peer + 1)),
                "coalesced": rt.all_reduce_coalesced(peer, [x, jnp.ones(3, jnp.int32)]),
            }

        inputs = [np.arange(6.0, dtype=np.float32) + peer for peer in range(PEERS)]
        for rank, got in enumerate(run_peers(PEERS, body, rt)):
            assert isinstance(got["all_gather"], jax.Array)
            np.testing.assert_array_equal(np.asarray(got["all_gather"]), np.stack(inputs))
            assert isinstance(got["reduce_scatter"], jax.Array)
            rows = slice(2 * rank, 2 * rank + 2)
            np.testing.assert_array_equal(np.asarray(got["reduce_scatter"]), sum(inputs)[rows])
            expected_a2a = np.concatenate([inputs[j][2 * rank : 2 * rank + 2] for j in range(PEERS)])
            np.testing.assert_array_equal(np.asarray(got["all_to_all"]), expected_a2a)
            np.testing.assert_array_equal(np.asarray(got["broadcast"]), inputs[0])
            # a peer that passed no array gets numpy (docs/frameworks.md)
            assert isinstance(got["broadcast"], jax.Array if rank == 0 else np.ndarray)
            if rank == 1:
                assert isinstance(got["gather"], jax.Array)
                np.testing.assert_array_equal(np.asarray(got["gather"]), np.stack(inputs))
            else:
                assert got["gather"] is None
            np.testing.assert_array_equal(np.asarray(got["scatter"]), inputs[2][2 * rank : 2 * rank + 2])
            assert isinstance(got["bfloat16"], jax.Array) and got["bfloat16"].dtype == jnp.bfloat16
            np.testing.assert_array_equal(np.asarray(got["bfloat16"], np.float32), np.full(3, 6.0))
            reduced, ints = got["coalesced"]
            assert isinstance(reduced, jax.Array) and isinstance(ints, jax.Array) and ints.dtype == jnp.int32
            np.testing.assert_array_equal(np.asarray(reduced), sum(inputs))
            np.testing.assert_array_equal(np.asarray(ints), np.full(3, PEERS))


def out_refused() -> None:
    """JAX arrays are immutable: out= with one is an InvalidArgumentError naming it, on every peer."""
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", col.CollectiveConfig(num_devices=PEERS, timeout=20))
            x = jnp.ones(4, jnp.float32)
            with pytest.raises(col.InvalidArgumentError, match="JAX array is immutable"):
                rt.all_reduce(peer, x, out=jnp.zeros(4, jnp.float32))
            with pytest.raises(col.InvalidArgumentError, match="JAX array is immutable"):
                rt.all_reduce_coalesced(peer, [x], out=[jnp.zeros(4, jnp.float32)])
            rt.send(peer, x, dst=(peer + 1) % PEERS)
            with pytest.raises(col.InvalidArgumentError, match=r"recv: peer .*JAX array is immutable"):
                rt.recv(peer, src=(peer - 1) % PEERS, out=jnp.zeros(4, jnp.float32))
            received = rt.recv(peer, src=(peer - 1) % PEERS)  # the message stayed first in line
            return rt.all_reduce(peer, x), received

        for reduced, received in run_peers(PEERS, body, rt):
            np.testing.assert_array_equal(np.asarray(reduced), np.full(4, PEERS))
            np.testing.assert_array_equal(received, np.ones(4))


def training() -> None:
    """Results on the input's device (run with two host devices: they came on the default one);
    GradientSync's stale results as JAX arrays (numpy ones came back); broadcast_parameters of
    immutable JAX arrays refused on every peer before any broadcast (numpy's "assignment
    destination is read-only" came after it)."""
    from collective.ddp import GradientSync, broadcast_parameters

    second = jax.devices()[-1]
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", col.CollectiveConfig(num_devices=PEERS, timeout=20))
            x = jax.device_put(jnp.full(3, peer + 1.0), second)
            placed = [rt.all_reduce(peer, x), rt.all_gather(peer, x)]
            sync = GradientSync(peer, {"w": np.zeros(3, np.float32)}, stale=True, runtime=rt)
            averages = []
            for step in range(2):
                sync.ready("w", jnp.full(3, float(peer + step), jnp.float32))
                averages.append(sync.wait())
            with pytest.raises(col.InvalidArgumentError, match="cannot be written in place"):
                broadcast_parameters(peer, [jnp.ones(2)], runtime=rt)
            return placed, averages

        for placed, averages in run_peers(PEERS, body, rt):
            assert all(result.devices() == {second} for result in placed), [r.devices() for r in placed]
            assert averages[0] is None and isinstance(averages[1]["w"], jax.Array)
            np.testing.assert_allclose(np.asarray(averages[1]["w"]), np.full(3, 1.0))


CHECKS = {
    "pytrees": pytrees,
    "every_collective": every_collective,
    "out_refused": out_refused,
    "training": training,
}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print(f"OK {sys.argv[1]}", flush=True)
