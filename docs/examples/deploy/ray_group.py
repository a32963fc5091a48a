"""A ray.util.collective group over this runtime: 2 actors sum their gradients in place.

Run it with `python ray_group.py` (a local Ray cluster is started), or `main()` on a cluster."""

import numpy as np
import ray
import ray.util.collective as rc


@ray.remote(num_cpus=0.5)
class Worker:
    def __init__(self, rank: int, world: int) -> None:
        import collective.ray  # noqa: F401  registers the backend "collective" in this actor's process

        self.rank = rank
        rc.init_collective_group(world, rank, backend="collective", group_name="grads")

    def step(self) -> list[float]:
        grad = np.full(4, float(self.rank + 1), np.float32)
        rc.allreduce(grad, group_name="grads")  # in place: the sum over the group
        return grad.tolist()

    def leave(self) -> None:
        rc.destroy_collective_group("grads")


def main(world: int = 2) -> list[list[float]]:
    workers = [Worker.remote(rank, world) for rank in range(world)]
    sums = ray.get([w.step.remote() for w in workers])
    ray.get([w.leave.remote() for w in workers])
    return sums


if __name__ == "__main__":
    ray.init()
    print(main())
