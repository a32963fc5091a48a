"""Ray Train over this runtime's torch.distributed backend: TorchConfig(backend="collective").

Each worker's init_process_group("collective") finds the backend by its entry point (nothing to
import), and prepare_model wraps the model in DDP over it. Run `python ray_train.py` (a local Ray
cluster is started), or `python ray_train.py gloo` for the same run under gloo: the final weights
are the same."""

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from ray import train
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer, prepare_model


def train_loop(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))  # (DDP over the group's backend)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(config["steps"]):
        loss = model(torch.full((8, 4), float(rank + step + 1))).pow(2).mean()  # (data differs per rank)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if rank == 0:  # (the weights are the same on every rank)
            torch.save(
                {"weights": model.module.state_dict(), "backend": dist.get_backend()}, f"{folder}/model.pt"
            )
            checkpoint = Checkpoint.from_directory(folder)
        train.report({"loss": loss.item()}, checkpoint=checkpoint)


def fit(backend: str = "collective", workers: int = 2, steps: int = 3, storage: str | None = None) -> dict:
    """Train; the checkpoint's contents: the final weights and the backend they were trained over."""
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"steps": steps},
        scaling_config=ScalingConfig(num_workers=workers),
        torch_config=TorchConfig(backend=backend),
        run_config=RunConfig(storage_path=storage),
    )
    with trainer.fit().checkpoint.as_directory() as folder:
        return torch.load(Path(folder) / "model.pt")


if __name__ == "__main__":
    print(fit(sys.argv[1] if len(sys.argv) > 1 else "collective"))
