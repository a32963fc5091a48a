"""Ray: the collective backend (collective.ray), a group of 2 actors on a local Ray cluster, every
op of ray.util.collective against numpy references, with numpy arrays and torch tensors; and Ray
Train over the torch backend, its weights those DDP computes. No Ray process outlives the module.

Skipped where Ray is not installed (the optional extra ``[ray]``; CI installs it).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.processes import reaping_orphans

ray = pytest.importorskip("ray")
pytest.importorskip("ray.util.collective.backend_registry")

pytestmark = pytest.mark.timeout(180)

WORLD = 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    with reaping_orphans():  # (a Ray Train controller once outlived the cluster that ran it)
        ray.init(num_cpus=WORLD + 1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        try:
            yield ray
        finally:
            ray.shutdown()


@ray.remote(num_cpus=0.5)
class Worker:
    """One rank: the ops of ray.util.collective on its arrays, results back to the test."""

    def setup(self, rank: int, group: str) -> int:
        import ray.util.collective as rc

        import collective.ray  # noqa: F401  (registers the backend in this actor's process)

        self.rank, self.group = rank, group
        rc.init_collective_group(WORLD, rank, backend="collective", group_name=group)
        return int(rc.get_rank(group))

    def every_op(self, kind: str) -> dict[str, Any]:
        import ray.util.collective as rc
        from ray.util.collective.types import ReduceOp

        rank, group, found = self.rank, self.group, {}

        def array(values: Any) -> Any:
            data = np.asarray(values, np.float32)
            if kind == "torch":
                import torch

                return torch.from_numpy(data.copy())
            return data.copy()

        def out(value: Any) -> list[float]:
            return [float(v) for v in np.asarray(value).reshape(-1)]

        x = array([rank + 1, 10 * (rank + 1)])
        rc.allreduce(x, group_name=group)
        found["allreduce"] = out(x)
        x = array([rank + 2, 1])
        rc.allreduce(x, group_name=group, op=ReduceOp.PRODUCT)
        found["allreduce prod"] = out(x)
        x = array([rank, -rank])
        rc.allreduce(x, group_name=group, op=ReduceOp.MAX)
        found["allreduce max"] = out(x)
        rc.barrier(group_name=group)
        x = array([rank + 1, 1])
        rc.reduce(x, dst_rank=1, group_name=group)
        found["reduce"] = out(x)
        x = array([rank * 7, 3])
        rc.broadcast(x, src_rank=1, group_name=group)
        found["broadcast"] = out(x)
        rows = [array([0, 0]) for _ in range(WORLD)]
        rc.allgather(rows, array([rank, rank + 100]), group_name=group)
        found["allgather"] = [out(row) for row in rows]
        y = array([0, 0])
        rc.reducescatter(y, [array([rank + r, 2 * r]) for r in range(WORLD)], group_name=group)
        found["reducescatter"] = out(y)
        if rank == 0:
            rc.send(array([5, 6]), 1, group_name=group)
        else:
            z = array([0, 0])
            rc.recv(z, 0, group_name=group)
            found["recv"] = out(z)
        return found

    def alone(self, milliseconds: int) -> str:
        """Rank 0's all_reduce that rank 1 never joins, bounded by Ray's ``timeout_ms``: the error."""
        from datetime import timedelta

        import ray.util.collective as rc
        from ray.util.collective.types import AllReduceOptions

        options = AllReduceOptions()
        options.timeout_ms = timedelta(milliseconds=milliseconds)
        try:
            rc.get_group_handle(self.group).allreduce([np.ones(2, np.float32)], options)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    def join(self, world: int, rank: int, group: str) -> None:
        import ray.util.collective as rc

        import collective.ray  # noqa: F401

        rc.init_collective_group(world, rank, backend="collective", group_name=group)

    def total(self, group: str, value: float) -> float:
        import ray.util.collective as rc

        x = np.full(3, value, np.float32)
        rc.allreduce(x, group_name=group)
        return float(x[0])

    def destroy(self) -> None:
        import ray.util.collective as rc

        rc.destroy_collective_group(self.group)


def expected(rank: int) -> dict[str, Any]:
    found: dict[str, Any] = {
        "allreduce": [3.0, 30.0],  # (1 + 2, 10 + 20)
        "allreduce prod": [6.0, 1.0],  # (2 x 3, 1 x 1)
        "allreduce max": [1.0, 0.0],
        "reduce": [3.0, 2.0] if rank == 1 else [rank + 1.0, 1.0],  # (the root's, in place)
        "broadcast": [7.0, 3.0],
        "allgather": [[0.0, 100.0], [1.0, 101.0]],
        "reducescatter": [2.0 * rank + 1.0, 4.0 * rank],  # (row r: sum over ranks of rank + r, 2r)
    }
    if rank == 1:
        found["recv"] = [5.0, 6.0]
    return found


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_every_op_of_a_two_actor_group(cluster: Any, kind: str) -> None:
    if kind == "torch":
        pytest.importorskip("torch")
    workers = [Worker.remote() for _ in range(WORLD)]
    group = f"test-{kind}"
    assert ray.get([w.setup.remote(rank, group) for rank, w in enumerate(workers)], timeout=120) == [0, 1]
    results = ray.get([w.every_op.remote(kind) for w in workers], timeout=120)
    for rank, found in enumerate(results):
        assert found == expected(rank), (rank, found)
    ray.get([w.destroy.remote() for w in workers], timeout=60)
    for worker in workers:
        ray.kill(worker)


def test_rays_timeout_bounds_a_call_and_our_error_names_the_missing_rank(cluster: Any) -> None:
    workers = [Worker.remote() for _ in range(WORLD)]
    assert ray.get([w.setup.remote(rank, "test-timeout") for rank, w in enumerate(workers)], timeout=120)
    said = ray.get(workers[0].alone.remote(500), timeout=60)
    assert said.startswith("CollectiveTimeout: all_reduce #0") and "peer 1" in said, said
    for worker in workers:
        ray.kill(worker)


def example(name: str) -> Any:
    """docs/examples/deploy/``name``.py as a module, its functions and actors sent to Ray's
    workers by value (they cannot import it)."""
    path = Path(__file__).parents[1] / "docs" / "examples" / "deploy" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"deploy_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)
    return module


def test_the_ray_group_example_sums_in_place(cluster: Any) -> None:
    assert example("ray_group").main() == [[3.0] * 4, [3.0] * 4]


def test_ray_train_over_the_torch_backend_trains_as_ddp_does(cluster: Any, tmp_path: Path) -> None:
    """docs/examples/deploy/ray_train.py: TorchTrainer(torch_config=TorchConfig(backend="collective"))
    (torch finds the backend by its entry point in every worker: nothing to import); the final
    weights equal, bit for bit, those of the same steps computed here as DDP computes them under
    any backend (gloo's included: tests/test_torch_backend.py compares the two directly)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("ray.train.torch")
    ours = example("ray_train").fit("collective", storage=str(tmp_path))
    assert ours["backend"] == "collective"
    expected = trained_as_ddp(torch, workers=2, steps=3)
    assert ours["weights"].keys() == expected.keys() == {"weight", "bias"}
    for name, weights in ours["weights"].items():
        assert torch.equal(weights, expected[name]), (ours, expected)


def trained_as_ddp(torch: Any, workers: int, steps: int) -> dict[str, Any]:
    """ray_train.py's training in one process, as DDP does it: each rank's gradient divided by the
    world size (DDP's default hook), summed across ranks, one SGD step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        grads = []
        for rank in range(workers):
            model.zero_grad()
            model(torch.full((8, 4), float(rank + step + 1))).pow(2).mean().backward()
            grads.append([p.grad / workers for p in model.parameters()])
        for p, parts in zip(model.parameters(), zip(*grads, strict=True), strict=True):
            p.grad = sum(parts)  # (in rank order, as the all_reduce adds them)
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_groups_of_some_actors_and_of_all_run_side_by_side(cluster: Any) -> None:
    """Ray's groups are named sets of actors with ranks of their own: a pair among three actors,
    beside the group of all three, each a job of its own."""
    workers = [Worker.remote() for _ in range(3)]
    ray.get([w.join.remote(3, rank, "all-three") for rank, w in enumerate(workers)], timeout=120)
    ray.get([w.join.remote(2, rank, "the-pair") for rank, w in enumerate(workers[1:])], timeout=120)
    for _ in range(2):  # (interleaved: each group's steps are its own)
        in_pair = ray.get([w.total.remote("the-pair", 10.0 * (i + 1)) for i, w in enumerate(workers[1:])])
        in_all = ray.get([w.total.remote("all-three", float(i)) for i, w in enumerate(workers)])
        assert in_pair == [30.0, 30.0] and in_all == [3.0, 3.0, 3.0], (in_pair, in_all)
    for worker in workers:
        ray.kill(worker)
