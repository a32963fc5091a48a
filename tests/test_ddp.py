"""collective.ddp: buckets in reverse order, overlap, no_sync, stale gradients, parameter broadcast."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collective as col
from collective.ddp import GradientSync, attach_torch, broadcast_parameters, torch_no_sync
from collective.launch import free_port
from tests.conftest import RUN_SETTINGS, outcomes_of_peers, run_peers, wait_until
from tests.processes import Proc, finish_all

N = 3
WORKER = str(Path(__file__).with_name("ddp_worker.py"))


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
                result = sync.wait(timeout=20 if step % 2 else None)  # bounded: the last bucket async too
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


def test_a_full_bucket_is_reduced_while_the_rest_of_backward_runs() -> None:
    """Overlap: the first bucket's all_reduce completes before the other gradients are even ready."""
    with col.Runtime() as rt:

        def body(peer: int) -> dict[str, Any]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params(), bucket_bytes=16 * 1024, runtime=rt)
            grads = grads_of(peer, 0)
            first, rest = sync.buckets
            for name in first:
                sync.ready(name, grads[name])
            # its all_reduce done (nothing of this peer pending), "embed" (the rest of backward) not made yet
            wait_until(lambda: rt.pending(peer) == 0, 20, f"peer {peer}'s first bucket synced")
            for name in rest:
                sync.ready(name, grads[name])
            result = sync.wait()
            rt.finish(peer)
            assert result is not None
            return result

        for result in run_peers(N, body, rt):
            np.testing.assert_allclose(result["head.w"], np.mean(range(N)))
            np.testing.assert_allclose(result["embed"], np.mean(range(N)))


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


def test_a_dropped_step_drops_the_micro_batches_no_sync_accumulated_for_it() -> None:
    """They stayed, and the next step's average added them (101 for 1)."""
    with col.Runtime() as rt:

        def body(peer: int) -> dict[str, Any]:
            rt.register(peer, "cpu", cfg())
            grads = {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)}
            sync = GradientSync(peer, grads, runtime=rt)
            with sync.no_sync():
                for name in ("b", "a"):
                    sync.ready(name, np.full(4, 100, np.float32))
            sync.ready("b", np.full(4, 1, np.float32))  # (backward raised before "a")
            with pytest.raises(col.InvalidArgumentError, match="this step is dropped"):
                sync.wait()
            for name in ("b", "a"):
                sync.ready(name, np.full(4, 1, np.float32))
            result = sync.wait()
            rt.finish(peer)
            assert result is not None
            return result

        for result in run_peers(N, body, rt):
            assert result["a"].tolist() == result["b"].tolist() == [1.0] * 4, result


def test_stale_mode_returns_the_previous_steps_average() -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params(), stale=True, runtime=rt)
            seen = []
            for step in range(5):  # the two sets of buffers take turns
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
        assert seen == [None, mean, mean + 10, mean + 20, mean + 30]


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


def test_the_flight_recorder_sees_the_hooks_calls_at_the_scripts_backward() -> None:
    """A bucket's all_reduce, started from a gradient hook inside backward, is recorded at the
    script's backward() line (not in torch.autograd nor collective.ddp)."""
    torch = pytest.importorskip("torch")
    from collective.trace import RECORDER
    from collective.trace.recorder import frame_of

    with col.Runtime() as rt:

        def body(peer: int) -> None:
            rt.register(peer, "cpu", cfg())
            model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
            sync = GradientSync(peer, dict(model.named_parameters()), bucket_bytes=64, runtime=rt)
            attach_torch(model, sync)
            model(torch.ones(2, 4)).sum().backward()  # BACKWARD
            sync.wait()

        run_peers(N, body, rt)
        frames = [frame_of(entry[4]) for entry in RECORDER.entries() if entry[3] == "all_reduce"]
    source = Path(__file__).read_text().splitlines()
    backward = next(i for i, line in enumerate(source, 1) if line.strip().endswith("# BACKWARD"))
    assert (__file__, backward) in {(frame["filename"], frame["line"]) for frame in frames}, frames


def test_mixed_dtypes_share_a_bucket_one_all_reduce_per_dtype() -> None:
    """float32, float64, float16 and int64 gradients in one bucket: each keeps its dtype and its values."""
    mixed = {
        "a": np.zeros(5, np.float32),
        "b": np.zeros((2, 3), np.float64),
        "c": np.zeros(4, np.float16),
        "d": np.zeros(3, np.int64),
        "e": np.zeros(2, np.float32),
    }
    with col.Runtime() as rt:
        calls: list[tuple[str, int]] = []  # the kind and peer of each call
        start = rt.start  # (the road of every call)

        def counted(peer: int, call: Any, *args: Any) -> Any:
            calls.append((call.kind, peer))
            return start(peer, call, *args)

        rt.start = counted  # type: ignore[method-assign]

        def body(peer: int) -> dict[str, np.ndarray]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, mixed, op="sum", runtime=rt)
            grads = {name: np.full(p.shape, peer + 1, p.dtype) for name, p in mixed.items()}
            for name in reversed(grads):
                sync.ready(name, grads[name])
            result = sync.wait()
            rt.finish(peer)
            assert result is not None
            return result

        per_peer = run_peers(N, body, rt)
    # one all_reduce per dtype, not one per gradient (and an all_gather: the peers' settings agree)
    assert sorted(calls) == sorted(
        [("all_gather", p) for p in range(N)] + [("all_reduce", p) for p in range(N)] * 4
    )
    total = sum(peer + 1 for peer in range(N))
    for result in per_peer:
        for name, p in mixed.items():
            assert result[name].dtype == p.dtype and result[name].shape == p.shape
            assert result[name].tolist() == np.full(p.shape, total, p.dtype).tolist()


def test_torch_mixed_dtypes_bfloat16_included() -> None:
    torch = pytest.importorskip("torch")
    with col.Runtime() as rt:

        def body(peer: int) -> dict[str, Any]:
            rt.register(peer, "cpu", cfg())
            model = torch.nn.Linear(4, 3)
            model.bias.data = model.bias.data.to(torch.bfloat16)
            model.weight.data = model.weight.data.to(torch.float64)
            sync = GradientSync(peer, dict(model.named_parameters()), runtime=rt)
            grads = {
                "weight": torch.full((3, 4), float(peer), dtype=torch.float64),
                "bias": torch.full((3,), float(peer), dtype=torch.bfloat16),
            }
            for name in ("bias", "weight"):
                sync.ready(name, grads[name])
            result = sync.wait()
            rt.finish(peer)
            assert result is not None and result["bias"] is grads["bias"]  # in place, still a tensor
            return result

        for result in run_peers(N, body, rt):
            assert result["weight"].dtype == torch.float64 and result["bias"].dtype == torch.bfloat16
            assert result["weight"].tolist() == [[1.0] * 4] * 3 and result["bias"].tolist() == [1.0] * 3


def test_a_gradient_unlike_its_parameter_is_refused() -> None:
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        sync = GradientSync(0, params(), runtime=rt)
        with pytest.raises(col.InvalidArgumentError, match=r"shape \(3,\).*parameter has shape \(10,\)"):
            sync.ready("head.b", np.zeros(3, np.float16))
        with pytest.raises(col.InvalidArgumentError, match=r"dtype float32.*dtype float16"):
            sync.ready("head.b", np.zeros(10, np.float32))
        rt.finish(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [2, 0], ids=["a worker", "rank 0 (hosts the orchestrator)"])
def test_a_process_killed_mid_step_is_an_error_on_every_other_peer(victim: int) -> None:
    """Real processes: SIGKILL one in the middle of a step; the others raise PeerLostError, no hang."""
    world, port = 3, free_port()
    env = {
        k: v
        for k, v in os.environ.items()
        if k in RUN_SETTINGS or not k.startswith(("COLLECTIVE_", "SLURM_", "OMPI_"))
    }
    env["COLLECTIVE_TIMEOUT"] = "90"  # far beyond the detection: an answer before it is not a timeout
    torchrun = {"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    procs = [
        Proc([sys.executable, WORKER, str(victim)], {**env, **torchrun, "RANK": str(r)}) for r in range(world)
    ]
    try:
        procs[victim].wait_for("MID-STEP", 60)
        killed = time.monotonic()
        procs[victim].process.send_signal(signal.SIGKILL)
        codes = finish_all([p for rank, p in enumerate(procs) if rank != victim], 60)
        took = time.monotonic() - killed
    finally:
        for proc in procs:
            proc.kill()
    for rank, proc in enumerate(procs):
        if rank == victim:
            continue
        output = proc.output()
        assert "STEP 0 OK" in output and "STEP 1 OK" not in output, output
        assert codes.pop(0) == 3 and f"LOST {rank} PeerLostError" in output, output
        if victim != 0:
            assert f"[{victim}]" in output, output  # the error names the dead peer
    assert took < 60  # answered by the loss of the peer, not by the 90 s collective timeout


@pytest.mark.parametrize(
    "theirs",
    [
        {"w": np.zeros((2, 4)), "b": np.zeros(2)},  # other shapes, the same total size
        {"b": np.zeros(2), "w": np.zeros((4, 2))},  # the same parameters in another order
        {"w2": np.zeros((4, 2)), "b": np.zeros(2)},  # another name
    ],
    ids=["shapes", "order", "names"],
)
def test_peers_with_different_parameters_are_refused_on_every_peer(theirs: dict[str, np.ndarray]) -> None:
    """Only the flat buffers' sizes had to agree: a peer's weights were averaged with another's."""
    mine = {"w": np.zeros((4, 2)), "b": np.zeros(2)}
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg())
            with pytest.raises(
                col.MismatchError, match=r"parameters \(.*peers 0, 2 hold model .*peer 1 hold"
            ):
                GradientSync(peer, theirs if peer == 1 else mine, runtime=rt)
            return GradientSync(peer, mine, runtime=rt).buckets  # the job goes on

        assert run_peers(N, body, rt) == [[["b", "w"]]] * N


@pytest.mark.parametrize(
    ("setting", "error", "message"),
    [
        (
            {"bucket_bytes": 0},
            col.InvalidArgumentError,
            r"peer 1.*bucket_bytes must be an integer > 0, got 0",
        ),
        ({"bucket_bytes": "25M"}, col.InvalidArgumentError, r"peer 1.*bucket_bytes must be .*, got '25M'"),
        ({"op": "avg"}, col.InvalidArgumentError, r"peer 1.*'avg'"),
        (
            {"params": {"w": {"nested": 0}}},
            col.InvalidArgumentError,
            r"peer 1.*params\['w'\] must be an array",
        ),
        ({"params": {}}, col.InvalidArgumentError, r"peer 1.*non-empty mapping"),
        ({"bucket_bytes": 64}, col.MismatchError, r"bucket_bytes: peers 0, 2 passed 1024, peer 1 passed 64"),
        ({"op": "sum"}, col.MismatchError, r"op: peers 0, 2 passed 'mean', peer 1 passed 'sum'"),
        ({"stale": True}, col.MismatchError, r"stale: peers 0, 2 passed False, peer 1 passed True"),
    ],
    ids=["bucket_bytes-0", "bucket_bytes-str", "op", "nested", "empty", "bucket_bytes", "op-2", "stale"],
)
def test_one_peers_bad_or_different_setting_fails_every_peer_at_once(
    setting: dict[str, Any], error: type[Exception], message: str
) -> None:
    """A bad setting on one peer raised there only (or an AttributeError for a nested parameter):
    the others waited for it in the agreement until their timeout. A different one was a
    MismatchError that named neither the peer nor the setting."""
    mine: dict[str, Any] = {"params": {"w": np.zeros((4, 2)), "b": np.zeros(2)}, "bucket_bytes": 1024}
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg(timeout=30))
            started = time.monotonic()
            with pytest.raises(error, match=message):
                GradientSync(peer, runtime=rt, **({**mine, **setting} if peer == 1 else mine))
            assert time.monotonic() - started < 10  # at once, not at the timeout
            return GradientSync(peer, runtime=rt, **mine).buckets  # the job goes on

        assert run_peers(N, body, rt) == [[["b", "w"]]] * N


def test_a_list_of_peer_ids_is_a_gradient_sync_group() -> None:
    """GradientSync(group=[0, 1]) raised AttributeError after its agreement had run on every peer."""
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg())
            if peer == 2:
                return None
            sync = GradientSync(peer, {"w": np.zeros(2)}, group=[0, 1], runtime=rt)
            sync.ready("w", np.full(2, float(peer)))
            return sync.wait()["w"].tolist()

        assert run_peers(N, body, rt) == [[0.5, 0.5], [0.5, 0.5], None]


def test_numpy_integers_are_bucket_bytes() -> None:
    with col.Runtime() as rt:
        rt.register(0, "cpu", col.CollectiveConfig(num_devices=1))
        sync = GradientSync(
            0, {"a": np.zeros(300), "b": np.zeros(300)}, bucket_bytes=np.int64(1024), runtime=rt
        )
        assert sync.buckets == [["b"], ["a"]]


@pytest.mark.parametrize(
    "bad",
    [{"nested": 1}, "w", np.zeros(3), np.float64(1.0)],
    ids=["dict", "str", "unwritable", "numpy-scalar"],
)
def test_broadcast_parameters_refuses_what_it_cannot_overwrite_on_every_peer(bad: Any) -> None:
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg(timeout=30))
            weights = [np.full(3, float(peer))]
            if isinstance(bad, np.ndarray):
                bad.flags.writeable = False
            with pytest.raises(col.InvalidArgumentError, match=r"peer 2.*broadcast_parameters: params"):
                broadcast_parameters(peer, [*weights, bad] if peer == 2 else weights, runtime=rt)
            broadcast_parameters(peer, weights, runtime=rt)  # the job goes on
            return weights[0].tolist()

        assert run_peers(N, body, rt) == [[0.0] * 3] * N


def test_a_step_whose_wait_timed_out_keeps_its_buffers_until_its_sync_ends() -> None:
    """wait(timeout) raised while the all_reduce went on; the next step wrote into its buffers: a
    late peer averaged its step 0 with the others' step 1 (100.5 for 0.5), silently."""
    params = {"w": np.zeros(4)}
    with col.Runtime() as rt:
        config = col.CollectiveConfig(num_devices=2, timeout=20)

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", config)
            sync = GradientSync(peer, params, runtime=rt)
            got: list[Any] = []
            for step in range(3):
                if peer == 1 and step == 0:
                    time.sleep(1.0)  # (kept: the late peer under test) late to step 0: peer 0 gives up on it
                sync.ready("w", np.full(4, 100.0 * step + (peer == 1)))
                try:
                    got.append(float(sync.wait(timeout=0.3 if peer == 0 else None)["w"][0]))
                except col.CollectiveTimeout:
                    got.append("timed out")
            return got

        first, second = run_peers(2, body, rt)
    assert first == ["timed out", 100.5, 200.5], first
    assert second == [0.5, 100.5, 200.5], second


def test_a_step_with_missing_gradients_is_dropped_and_the_next_one_works() -> None:
    """After a backward that raised, every step raised 'ready(...) called twice': no way back."""
    params = {"a": np.zeros(2), "b": np.zeros(3)}
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params, bucket_bytes=16, runtime=rt)
            sync.ready("b", np.ones(3))  # backward raised before "a" was made
            with pytest.raises(col.InvalidArgumentError, match=r"made no gradient ready for \['a'\]"):
                sync.wait()
            sync.ready("b", np.full(3, peer + 1.0))
            sync.ready("a", np.full(2, peer + 1.0))
            return sync.wait()

        for result in run_peers(N, body, rt):
            np.testing.assert_array_equal(result["a"], np.full(2, 2.0))
            np.testing.assert_array_equal(result["b"], np.full(3, 2.0))


def test_a_gradient_missing_on_one_peer_fails_the_step_on_every_peer_at_once() -> None:
    """Peer 0's backward made no gradient for "b": the others waited in its bucket's all_reduce for
    the whole timeout. Now each of them gets peer 0's problem at once and the next step works."""
    params = {"a": np.zeros(2), "b": np.zeros(2), "c": np.zeros(2)}  # one bucket each: c, b, a
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg(timeout=60))
            sync = GradientSync(peer, params, bucket_bytes=16, runtime=rt)
            for name in ("c", "b", "a"):
                if name != "b" or peer != 0:
                    sync.ready(name, np.ones(2))
            started = time.monotonic()
            with pytest.raises(col.InvalidArgumentError, match=r"peer 0 made no gradient ready for \['b'\]"):
                sync.wait()
            took = time.monotonic() - started
            for name in ("c", "b", "a"):
                sync.ready(name, np.full(2, peer + 1.0))
            return took, sync.wait()

        for took, result in run_peers(N, body, rt):
            assert took < 30, took  # told by peer 0, not by the 60 s timeout
            for name in params:
                np.testing.assert_array_equal(result[name], np.full(2, 2.0))


def test_with_stale_a_missing_gradient_fails_the_same_wait_on_every_peer() -> None:
    """stale=True: the peer that missed a gradient raised at once while the others returned the
    previous averages; they then fell out of step (each raised at a different wait)."""
    params = {"a": np.zeros(2), "b": np.zeros(2), "c": np.zeros(2)}
    with col.Runtime() as rt:

        def body(peer: int) -> list[Any]:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params, bucket_bytes=16, op="sum", runtime=rt, stale=True)
            seen: list[Any] = []
            for step in range(1, 5):
                for name in ("c", "b", "a"):
                    if not (step == 2 and peer == 0 and name == "b"):
                        sync.ready(name, np.full(2, 10.0 * step + peer))
                try:
                    got = sync.wait()
                    seen.append(None if got is None else float(got["a"][0]))
                except col.InvalidArgumentError as exc:
                    assert "peer 0 made no gradient ready for ['b']" in str(exc)
                    seen.append("error")
            return seen

        for seen in run_peers(N, body, rt):
            assert seen == [None, 33.0, "error", 93.0], seen  # (step k's sum over 3 peers: 30k + 3)


def test_immutable_gradients_come_back_as_new_arrays() -> None:
    """A JAX gradient (read through numpy, read-only) raised a bare ValueError in wait()."""
    params = {"w": np.zeros(3)}
    with col.Runtime() as rt:

        def body(peer: int) -> Any:
            rt.register(peer, "cpu", cfg())
            sync = GradientSync(peer, params, runtime=rt)
            grad = np.full(3, peer + 1.0)
            grad.flags.writeable = False  # as np.asarray(jax_array) reads
            sync.ready("w", grad)
            return grad, sync.wait()["w"]

        for grad, result in run_peers(N, body, rt):
            assert result is not grad and result.flags.writeable
            np.testing.assert_array_equal(result, np.full(3, 2.0))
