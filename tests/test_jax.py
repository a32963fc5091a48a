"""Direct calls with JAX arrays: numpy-level interop, and the pytree recipe of docs/frameworks.md.

JAX is optional (and large): the test skips where it is not installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collective as col
from tests.conftest import run_peers

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

PEERS = 3


def test_jax_arrays_and_pytrees() -> None:
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
