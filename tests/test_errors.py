"""Bad input, mismatched calls, missing and departed peers: a clear error on every peer, never a hang."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import collective as col
from collective import Ring, Tree
from tests.conftest import outcomes_of_peers, run_peers, wait_until

TIMEOUT = 0.5


def cfg(n: int, timeout: float = 10.0, strategy: Any = "tree:2") -> col.CollectiveConfig:
    return col.CollectiveConfig(
        num_devices=n,
        timeout=timeout,
        local_all_reduce_strategy=strategy,
        local_reduce_strategy=strategy,
        local_broadcast_strategy=strategy,
    )


def then_usable(rt: col.Runtime, peer: int, n: int) -> np.ndarray:
    """A correct all_reduce after the failed step: the job must still work."""
    return rt.all_reduce(peer, np.full(3, peer, np.int64))


def run_failing_step(
    rt: col.Runtime, n: int, step: Callable[[int], Any], config: col.CollectiveConfig | None = None
) -> list[Any]:
    """Every peer registers, runs ``step`` (expected to fail), then one good all_reduce, then finishes.

    Returns per peer the exception of the failed step (or its result) and checks the good step.
    """

    def body(peer: int) -> Any:
        rt.register(peer, "cpu", config or cfg(n))
        try:
            outcome: Any = step(peer)
        except col.CollectiveError as exc:
            outcome = exc
        good = then_usable(rt, peer, n)
        rt.finish(peer)
        return outcome, good

    results = run_peers(n, body, rt)
    for _, good in results:
        np.testing.assert_array_equal(good, np.full(3, n * (n - 1) // 2))
    return [outcome for outcome, _ in results]


@pytest.fixture(params=["fused", "shared", "link"])
def rt(request: pytest.FixtureRequest) -> Any:
    """Errors must be the same on the in-process fast paths and over the algorithms."""
    limits = {"fused": {}, "shared": {"fuse_below": 0}, "link": {"fuse_below": 0, "share_below": 0}}
    with col.Runtime(**limits[request.param]) as runtime:
        yield runtime


# -- mismatches -------------------------------------------------------------------------------


def test_shape_mismatch_names_the_peers_everywhere(rt: col.Runtime) -> None:
    errors = run_failing_step(rt, 4, lambda p: rt.all_reduce(p, np.zeros((4, 9) if p == 3 else (4, 8))))
    for error in errors:
        assert isinstance(error, col.MismatchError)
        assert "all_reduce #0" in str(error)
        assert "shape: peers 0-2 passed (4, 8), peer 3 passed (4, 9)" in str(error)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(4, np.float32 if p else np.float64)),
            "dtype: peer 0 passed float64, peers 1-2 passed float32",
        ),
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(4), "max" if p == 1 else "sum"),
            "op: peers 0, 2 passed sum, peer 1 passed max",
        ),
        (
            lambda rt, p: rt.reduce(p, np.zeros(4), root=2 if p == 0 else 1),
            "root: peer 0 passed 2, peers 1-2 passed 1",
        ),
        (
            lambda rt, p: rt.reduce(p, np.zeros(4)) if p == 2 else rt.all_reduce(p, np.zeros(4)),
            "peers called different collectives: peers 0-1 passed all_reduce, peer 2 passed reduce",
        ),
        (
            lambda rt, p: rt.broadcast(p, None),
            "exactly one peer (the root) must pass an array; no peer passed one",
        ),
        (
            lambda rt, p: rt.broadcast(p, np.zeros(3) if p != 1 else None),
            "exactly one peer (the root) must pass an array; peers 0, 2 passed one",
        ),
        (
            lambda rt, p: rt.broadcast(
                p, np.zeros(3) if p == 0 else None, out=np.zeros(4) if p == 2 else None
            ),
            "shape: peer 0 passed (3,), peer 2 passed (4,)",
        ),
    ],
    ids=["dtype", "op", "root", "collective", "broadcast-none", "broadcast-two", "broadcast-out"],
)
def test_mismatches_fail_every_peer_and_leave_the_job_usable(
    rt: col.Runtime, call: Any, expected: str
) -> None:
    errors = run_failing_step(rt, 3, lambda p: call(rt, p))
    for error in errors:
        assert isinstance(error, col.MismatchError), error
        assert expected in str(error)


def test_mismatch_with_large_arrays_fails_before_any_data_moves(rt: col.Runtime) -> None:
    n = 4
    errors = run_failing_step(
        rt, n, lambda p: rt.all_reduce(p, np.zeros(100_000 + (p == 2), np.float32)), cfg(n, strategy=Ring())
    )
    assert all(isinstance(e, col.MismatchError) and "peer 2 passed (100001,)" in str(e) for e in errors)


# -- invalid arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(3), "avg" if p == 1 else "sum"),
            "peer 1: unknown reduce op 'avg': expected one of sum, mean, max, min, prod",
        ),
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(3, bool if p == 0 else float)),
            "peer 0: unsupported dtype bool",
        ),
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(3, np.complex64), "max"),
            "op max is not defined for complex64",
        ),
        (
            lambda rt, p: rt.all_reduce(p, [1.0, 2.0] if p == 2 else np.zeros(2)),
            "peer 2: x must be an array (numpy, CuPy, torch, JAX, or anything with __array_interface__ or "
            "__dlpack__), got list",
        ),
        (lambda rt, p: rt.reduce(p, np.zeros(3), root=7), "root 7 is not a peer of the group (peers 0-2)"),
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(3), out=np.zeros(4) if p == 1 else None),
            "peer 1: out has shape (4,)",
        ),
        (
            lambda rt, p: rt.all_reduce(p, (x := np.zeros(6)), out=x[1:4] if p == 0 else None),
            "peer 0: out has shape (3,)",
        ),
        (
            lambda rt, p: rt.all_reduce(p, (x := np.zeros(6))[:3], out=x[1:4] if p == 0 else None),
            "peer 0: out overlaps x without being x",
        ),
        (
            lambda rt, p: rt.all_reduce(p, np.zeros(3), out=np.zeros((3, 2))[:, 0] if p == 0 else None),
            "peer 0: out must be a writeable C-contiguous array",
        ),
    ],
    ids=[
        "op",
        "dtype",
        "complex-max",
        "not-an-array",
        "root",
        "out-shape",
        "out-view",
        "out-overlap",
        "out-strided",
    ],
)
def test_invalid_arguments_fail_every_peer(rt: col.Runtime, call: Any, expected: str) -> None:
    errors = run_failing_step(rt, 3, lambda p: call(rt, p))
    for error in errors:
        assert isinstance(error, col.InvalidArgumentError) and isinstance(error, ValueError), error
        assert expected in str(error)


# -- registration -----------------------------------------------------------------------------


def test_use_before_register_and_after_finish(runtime: col.Runtime) -> None:
    with pytest.raises(col.RegistrationError, match=r"peer 0 is not registered: call register\(\) first"):
        runtime.all_reduce(0, np.zeros(2))
    runtime.register(0, "cpu", cfg(1))
    runtime.finish(0)
    with pytest.raises(
        col.RegistrationError, match=r"peer 0 has finished: call register\(\) to start a new job"
    ):
        runtime.all_reduce(0, np.zeros(2))
    with pytest.raises(col.RegistrationError, match="has finished"):
        runtime.finish(0)
    runtime.register(0, "cpu", cfg(1))  # and a new job works
    np.testing.assert_array_equal(runtime.all_reduce(0, np.ones(2)), np.ones(2))


@pytest.mark.parametrize("peer", [4, -1, 1.5, True, "0"])
def test_peer_id_outside_the_job(runtime: col.Runtime, peer: Any) -> None:
    with pytest.raises(
        col.RegistrationError, match=r"is outside the job: with num_devices=4 the peers are 0\.\.3"
    ):
        runtime.register(peer, "cpu", cfg(4))


def test_register_twice_while_waiting_and_after_joining(runtime: col.Runtime) -> None:
    first = threading.Thread(target=lambda: runtime.register(0, "cpu", cfg(2)), daemon=True)
    first.start()
    wait_until(runtime.has_job, 5, "peer 0 registered (waiting for peer 1)")
    with pytest.raises(col.RegistrationError, match=r"peer 0 is already registered; call finish\(0\) first"):
        runtime.register(0, "cpu", cfg(2))
    runtime.register(1, "cpu", cfg(2))
    first.join(5)
    assert not first.is_alive()
    with pytest.raises(col.RegistrationError, match="already registered"):
        runtime.register(1, "cpu", cfg(2))


def test_a_different_config_while_a_job_runs(runtime: col.Runtime) -> None:
    runtime.register(0, "cpu", cfg(1))
    with pytest.raises(col.RegistrationError, match=r"num_devices=2 vs 1"):
        runtime.register(1, "cpu", cfg(2))


def test_finished_peer_cannot_rejoin_a_running_job(runtime: col.Runtime) -> None:
    run_peers(2, lambda p: runtime.register(p, "cpu", cfg(2)), runtime)
    runtime.finish(0)
    with pytest.raises(col.RegistrationError, match="already finished this job; it cannot rejoin it"):
        runtime.register(0, "cpu", cfg(2))


def test_unknown_device(runtime: col.Runtime) -> None:
    with pytest.raises(col.RegistrationError, match="unknown device 'tpu'"):
        runtime.register(0, "tpu", cfg(1))


def test_registration_timeout_names_the_missing_peers(runtime: col.Runtime) -> None:
    started = time.monotonic()
    outcomes = outcomes_of_peers(2, lambda p: runtime.register(p, "cpu", cfg(3, TIMEOUT)), runtime)
    assert time.monotonic() - started < TIMEOUT + 2
    for error in outcomes:
        assert isinstance(error, col.CollectiveTimeout) and isinstance(error, TimeoutError)
        assert error.missing == (2,) and "for peer 2 to register" in str(error)
    run_peers(3, lambda p: runtime.register(p, "cpu", cfg(3, TIMEOUT)), runtime)  # nothing was left behind


# -- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_devices": 0}, "num_devices must be >= 1, got 0"),
        ({"num_devices": 2.0}, "num_devices must be an integer"),
        (
            {"local_all_reduce_strategy": "tree:0"},
            "local_all_reduce_strategy: Tree arity must be an integer >= 1",
        ),
        ({"local_reduce_strategy": "tree:x"}, "the tree arity must be an integer"),
        ({"local_broadcast_strategy": "butterfly"}, "unknown strategy 'butterfly'"),
        (
            {"global_all_reduce_strategy": 3},
            "must be Auto(), Centralized(), Tree(k), Ring(), Direct() or a string",
        ),
        ({"num_nodes": 2}, "must be all set or all unset: num_nodes set but global_address, node_address"),
        (
            {"num_nodes": 2, "global_address": "h:1", "node_address": "h:2", "data_service_port": 70000},
            "data_service_port must be in 0..65535",
        ),
        (
            {"num_nodes": 2, "global_address": "nohost", "node_address": "h:2", "data_service_port": 0},
            "global_address must be 'host:port'",
        ),
        ({"timeout": 0}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": math.nan}, "timeout must be a finite number of seconds > 0"),
        ({"timeout": "5"}, "timeout must be a number of seconds"),
    ],
)
def test_invalid_config_raises_at_construction(kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(col.ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")) as info:
        col.CollectiveConfig(**kwargs)
    assert isinstance(info.value, ValueError)


def test_tree_zero_is_a_config_error() -> None:
    with pytest.raises(col.ConfigError, match="Tree arity must be an integer >= 1, got 0"):
        Tree(0)


def test_config_is_frozen_and_parses_strategies() -> None:
    config = col.CollectiveConfig(
        num_devices=2, local_reduce_strategy=" Tree:3 ", local_broadcast_strategy="tree"
    )
    assert config.local_reduce_strategy == Tree(3) and config.local_broadcast_strategy == Tree(2)
    assert config.global_all_reduce_strategy == col.Auto()  # (the default of every kind)
    with pytest.raises(AttributeError):
        config.num_devices = 3  # type: ignore[misc]


# -- timeouts, departures, reset, misuse -------------------------------------------------------


def test_a_peer_that_never_arrives_times_out_the_others_and_the_job_recovers(rt: col.Runtime) -> None:
    late = threading.Event()

    def step(peer: int) -> Any:
        if peer == 2:
            assert late.wait(10)
        started = time.monotonic()
        try:
            return rt.all_reduce(peer, np.ones(4))
        finally:
            if peer == 0:
                assert time.monotonic() - started < TIMEOUT + 1
                late.set()

    errors = run_failing_step(rt, 3, step, cfg(3, TIMEOUT))
    for error in errors:  # the late peer finds the same verdict, then everyone moves on together
        assert isinstance(error, col.CollectiveTimeout) and error.missing == (2,)
        assert "all_reduce #0: peers waited 0.5s for peer 2 to call it" in str(error)


def test_finish_while_others_wait_is_a_peer_lost_error(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        rt.register(peer, "cpu", cfg(3))
        if peer == 2:  # once the others wait for it inside the all_reduce
            wait_until(lambda: rt.waiting() == (0, 1), 10, "peers 0 and 1 waiting in the all_reduce")
            rt.finish(peer)
            return None
        started = time.monotonic()
        with pytest.raises(col.PeerLostError, match="peer 2 called finish") as first:
            rt.all_reduce(peer, np.ones(2))
        assert time.monotonic() - started < 2 and first.value.peers == (2,)
        with pytest.raises(col.PeerLostError, match=r"left the job \(finish\)") as later:
            rt.broadcast(peer, None)  # fails at once: the job cannot complete a collective any more
        assert 2 in later.value.peers
        rt.finish(peer)
        return None

    run_peers(3, body, rt)


def test_reset_wakes_blocked_peers_with_job_closed(rt: col.Runtime) -> None:
    def body(peer: int) -> Any:
        if peer == 2:  # once peer 0 is registering
            wait_until(rt.has_job, 10, "peer 0 registering")
            rt.reset()
            return None
        rt.register(peer, "cpu", cfg(3)) if peer == 0 else None
        return None

    outcomes = outcomes_of_peers(3, body, rt)
    assert isinstance(outcomes[0], col.JobClosedError) and "reset" in str(outcomes[0])

    run_peers(2, lambda p: rt.register(p, "cpu", cfg(2)), rt)

    def reset_once_peer_0_waits() -> None:
        wait_until(lambda: rt.waiting() == (0,), 10, "peer 0 waiting in the all_reduce")
        rt.reset()

    blocked = outcomes_of_peers(
        2, lambda p: rt.all_reduce(p, np.ones(3)) if p == 0 else reset_once_peer_0_waits(), rt
    )
    assert isinstance(blocked[0], col.JobClosedError)
    with pytest.raises(col.RegistrationError, match="not registered"):
        rt.all_reduce(0, np.ones(3))


def test_one_peer_driven_by_two_threads_runs_its_calls_in_the_order_issued(rt: col.Runtime) -> None:
    """A second thread's call on a peer waits its turn instead of being refused (or racing)."""
    run_peers(2, lambda p: rt.register(p, "cpu", cfg(2)), rt)
    results: dict[str, Any] = {}
    first = threading.Thread(target=lambda: results.update(first=rt.all_reduce(0, np.ones(2))), daemon=True)
    first.start()
    wait_until(lambda: rt.waiting() == (0,), 5, "the first call waiting for peer 1 inside the rendezvous")
    second = threading.Thread(
        target=lambda: results.update(second=rt.all_reduce(0, np.full(2, 5.0))), daemon=True
    )
    second.start()
    wait_until(lambda: rt.pending(0) == 2, 5, "the second call queued behind the first")
    np.testing.assert_array_equal(rt.all_reduce(1, np.ones(2)), [2, 2])  # meets the first call
    np.testing.assert_array_equal(rt.all_reduce(1, np.ones(2)), [6, 6])  # then the second
    first.join(5)
    second.join(5)
    assert not first.is_alive() and not second.is_alive()
    np.testing.assert_array_equal(results["first"], [2, 2])
    np.testing.assert_array_equal(results["second"], [6, 6])


def test_a_failure_inside_one_peer_fails_the_collective_for_all(monkeypatch: pytest.MonkeyPatch) -> None:
    import collective.transport.inproc

    real = collective.transport.inproc.combine

    def flaky(*args: Any) -> None:
        if threading.current_thread().name == "peer-1":
            raise MemoryError("simulated")
        real(*args)

    monkeypatch.setattr(collective.transport.inproc, "combine", flaky)
    with col.Runtime(fuse_below=0, share_below=0) as rt:
        outcomes = outcomes_of_peers(
            4, lambda p: (rt.register(p, "cpu", cfg(4)), rt.all_reduce(p, np.ones(8))), rt
        )
    assert isinstance(outcomes[1], MemoryError)
    for peer in (0, 2, 3):
        assert isinstance(outcomes[peer], col.PeerLostError), outcomes[peer]
        assert "peer 1 failed: MemoryError('simulated')" in str(outcomes[peer])


def test_config_from_the_environment() -> None:
    env = {
        "COLLECTIVE_NUM_DEVICES": "3",
        "COLLECTIVE_LOCAL_ALL_REDUCE_STRATEGY": "direct",
        "COLLECTIVE_TIMEOUT": "2.5",
        "COLLECTIVE_JOB": "j",
        "UNRELATED": "x",
    }
    config = col.CollectiveConfig.from_env(env, timeout=4)
    assert (config.num_devices, config.local_all_reduce_strategy, config.timeout, config.job) == (
        3,
        col.Direct(),
        4,
        "j",
    )
    with pytest.raises(col.ConfigError, match="COLLECTIVE_NUM_NODES='two' is not a number"):
        col.CollectiveConfig.from_env({"COLLECTIVE_NUM_NODES": "two"})
    with pytest.raises(col.ConfigError, match="COLLECTIVE_NUM_DEVICES='0': num_devices must be >= 1, got 0"):
        col.CollectiveConfig.from_env({"COLLECTIVE_NUM_DEVICES": "0"})
    with pytest.raises(col.ConfigError, match=r"COLLECTIVE_TIMEOUT='-1': timeout must be a finite number"):
        col.CollectiveConfig.from_env({"COLLECTIVE_TIMEOUT": " -1 "})
    with pytest.raises(col.ConfigError, match=r"COLLECTIVE_TOKEN=\*\*\*: token must be a non-empty string"):
        col.CollectiveConfig.from_env({"COLLECTIVE_TOKEN": "  "})
    assert "s3cret" not in repr(col.CollectiveConfig(token="s3cret"))
