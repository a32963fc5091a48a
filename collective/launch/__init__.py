"""Processes of a job: who this process is, how it joins, and starting a job's processes.

* ``launchers``: which process this is (rank, world, job, meeting point) from the launcher's
  variables (torchrun, Slurm, Open MPI, ``collective launch``);
* ``bootstrap``: ``init()``, one peer per process (rank 0's embedded orchestrator), and
  ``init_with_store`` for torch's own store;
* ``commands``: ``collective orchestrator`` and ``collective launch``, and the helpers benchmarks
  and tests start processes with (re-exported here).
"""

from __future__ import annotations

from collective.launch.commands import (
    Stopped,
    add_launch_arguments,
    add_orchestrator_arguments,
    free_port,
    launch,
    node_environment,
    peer_ids_from_env,
    seconds_argument,
    serve_orchestrator,
    start_orchestrator,
    stop_processes,
    stop_status,
    stopped_by_signals,
)

__all__ = [
    "Stopped",
    "add_launch_arguments",
    "add_orchestrator_arguments",
    "free_port",
    "launch",
    "node_environment",
    "peer_ids_from_env",
    "seconds_argument",
    "serve_orchestrator",
    "start_orchestrator",
    "stop_processes",
    "stop_status",
    "stopped_by_signals",
]
