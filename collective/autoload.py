"""torch's backend autoload: the name "collective" known to torch.distributed in every process.

torch calls the entry points of the group ``torch.backends`` as it is imported (its device-backend
autoload, TORCH_DEVICE_BACKEND_AUTOLOAD=1 by default), so a process that never imports
``collective.torch`` (a Ray Train worker, a script that names the backend in its configuration, a
subprocess) can still ``dist.init_process_group("collective")``. ``register`` only tells torch the
name and a creator; the runtime (numpy, ZeroMQ, the backend itself) loads when the first group of
the backend is created, so ``import torch`` pays for nothing else. It never raises: a failure here
would fail ``import torch`` itself; it is logged and the backend is then registered by
``import collective.torch`` as before.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BACKEND", "register"]

BACKEND = "collective"

log = logging.getLogger(__name__)


def register() -> None:
    """Tell torch.distributed the backend's name and its (lazy) creator; once per process."""
    try:
        import torch.distributed as dist

        if dist.is_available() and BACKEND not in dist.Backend.backend_list:
            dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    except Exception:  # (torch would fail to import: say why, and let import collective.torch do it)
        log.warning(
            "could not register the torch.distributed backend %r at torch's import", BACKEND, exc_info=True
        )


def _create(options: Any, backend_options: Any = None) -> Any:
    from collective.torch import create

    return create(options, backend_options)
