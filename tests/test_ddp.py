"""collective.ddp: buckets in reverse order, overlap, no_sync, stale gradients, parameter broadcast."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collective as col
from collective.ddp import GradientSync, attach_torch, broadcast_parameters, torch_no_sync
from tests.conftest import outcomes_of_peers, run_peers

N = 3


def cfg(timeout: float = 20.0) -> col.CollectiveConfig:
    return col.CollectiveConfig(num_devices=N, timeout=timeout)


def params() -> dict[str, np.ndarray]:
    """A tiny model's parameters, mixed dtypes, in definition order."""
    return {
        "embed": np.zeros(1000, np.float32),
        "layer1.w": np.zeros((64, 64), np.float32),
        "layer1.b": np.zeros(64, np.float64),
        "head.w": np.zeros((10, 64), np.float32),
        "head.b": np.zeros(10, np.float16),
    }


def grads_of(peer: int, step: int) -> dict[str, np.ndarray]:
    return {name: np.full(p.shape, peer + 10 * step, p.dtype) for name, p in params().items()}


def test_buckets_follow_reverse_definition_order_and_size() -> None:
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        sync = GradientSync(0, params(), bucket_bytes=16 * 1024, runtime=rt)
        assert sync.buckets == [["head.b", "head.w", "layer1.b", "layer1.w"], ["embed"]]
        one = GradientSync(0, params(), runtime=rt)
        assert one.buckets == [["head.b", "head.w", "layer1.b", "layer1.w", "embed"]]
        with pytest.raises(col.InvalidArgumentError, match="not a parameter"):
            one.ready("nope", np.zeros(1))


@pytest.mark.parametrize("order", ["backward", "shuffled"])
def test_mean_of_every_gradient_whatever_order_they_become_ready(order: str) -> None:
    """Buckets start in bucket order on every peer even when gradients arrive in another order."""
    with col.Runtime() as rt:

        def body(peer: int) -> list[dict[str, Any]]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params(), bucket_bytes=4096, runtime=rt)
            synced = []
            for step in range(3):
                grads = grads_of(peer, step)
                names = list(reversed(grads))
                if order == "shuffled":
                    np.random.default_rng(peer * 7 + step).shuffle(names)
                for name in names:
                    sync.ready(name, grads[name])
                result = sync.wait()
                assert result is not None and all(result[n] is grads[n] for n in grads)  # in place
                synced.append({n: g.copy() for n, g in result.items()})
            rt.finish(peer)
            return synced

        per_peer = run_peers(N, body, rt)
    for step in range(3):
        for name, p in params().items():
            expected = np.mean([peer + 10 * step for peer in range(N)])
            for peer in range(N):
                got = per_peer[peer][step][name]
                assert got.dtype == p.dtype
                np.testing.assert_allclose(got, np.full(p.shape, expected), rtol=1e-3)


def test_no_sync_accumulates_micro_batches_and_syncs_once() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> dict[str, Any]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params(), runtime=rt)
            with sync.no_sync():
                for micro in range(2):
                    for name, grad in grads_of(peer, micro).items():
                        sync.ready(name, grad)
            last = grads_of(peer, 2)
            for name in reversed(last):
                sync.ready(name, last[name])
            result = sync.wait()
            rt.finish(peer)
            assert result is not None
            return result

        per_peer = run_peers(N, body, rt)
    expected = np.mean([sum(peer + 10 * step for step in range(3)) for peer in range(N)])
    for result in per_peer:
        np.testing.assert_allclose(result["layer1.w"], expected)


def test_stale_mode_returns_the_previous_steps_average() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params(), stale=True, runtime=rt)
            seen = []
            for step in range(3):
                grads = grads_of(peer, step)
                for name in reversed(grads):
                    sync.ready(name, grads[name])
                result = sync.wait()
                seen.append(None if result is None else float(result["head.w"][0, 0]))
                grads["head.w"][...] = -1  # reusing the gradient buffers does not disturb the sync
            rt.finish(peer)
            return seen

        per_peer = run_peers(N, body, rt)
    mean = np.mean(range(N))
    for seen in per_peer:
        assert seen == [None, mean, mean + 10]


def test_broadcast_parameters_gives_every_peer_the_roots_weights() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> list[np.ndarray]:
            rt.register(peer, "cpu", cfg())
            weights = [
                np.full((4, 4), peer, np.float32),
                np.full(3, peer, np.int64),
                np.full(2, -peer, np.float32),
            ]
            broadcast_parameters(peer, weights, root=1, runtime=rt)
            rt.finish(peer)
            return weights

        for weights in run_peers(N, body, rt):
            assert weights[0].tolist() == np.full((4, 4), 1.0).tolist()
            assert weights[1].tolist() == [1, 1, 1] and weights[2].tolist() == [-1, -1]


def test_a_peer_that_leaves_mid_step_is_an_error_on_every_other_peer() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg(timeout=30))
            sync = GradientSync(peer, params(), bucket_bytes=4096, runtime=rt)
            grads = grads_of(peer, 0)
            if peer == 2:
                sync.ready("head.b", grads["head.b"])  # one bucket, then the peer dies
                rt.finish(peer)
                return "left"
            for name in reversed(grads):
                sync.ready(name, grads[name])
            return sync.wait(timeout=20)

        outcomes = outcomes_of_peers(N, body, rt, timeout=40)
    assert outcomes[2] == "left"
    for outcome in outcomes[:2]:
        assert isinstance(outcome, col.PeerLostError), outcome


def test_torch_hooks_sync_after_backward_and_survive_zero_grad() -> None:
    torch = pytest.importorskip("torch")
    with col.Runtime() as rt:

        def body(peer: int) -> list[float]:
            rt.register(peer, "cpu", cfg())
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            sync = GradientSync(peer, dict(model.named_parameters()), bucket_bytes=64, runtime=rt)
            attach_torch(model, sync)
            losses = []
            for step in range(2):
                model.zero_grad(set_to_none=True)
                x = torch.full((2, 4), float(peer + step))
                with torch_no_sync(sync):
                    model(x).sum().backward()  # a micro-batch: torch accumulates, nothing is sent
                model(x).sum().backward()
                sync.wait()
                losses.append(float(model[2].bias.grad))
            rt.finish(peer)
            return losses

        per_peer = run_peers(N, body, rt)
    assert per_peer[0] == per_peer[1] == per_peer[2]  # averaged over peers
    assert per_peer[0] == [4.0, 4.0]  # d(sum)/d(bias) = 2 rows x 2 backward passes, on every peer
