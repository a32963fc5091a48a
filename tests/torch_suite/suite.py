"""The test class of torch's distributed suite for one backend, configured by the environment.

Imported by the runner (``tests/torch_suite/run.py``) and again, by name, in every process the
suite spawns (``multiprocessing`` "spawn" unpickles ``TestDistBackendWithSpawn._run`` from this
module), so everything that must hold in those processes happens here, at import, before torch's
``distributed_test`` is imported (its decorators read ``BACKEND`` and ``DistTestCases`` then):

- ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` as torch's ``run_test.py`` sets them (the runner does);
- ``COLLECTIVE_TORCH_SUITE_MODE``: ``gloo`` (torch's own run), ``collective`` (``import
  collective.torch`` registers the backend, and it is claimed to have the features of a CPU
  backend with DDP and subgroups: ``DistTestCases.backend_feature["ddp"|"subgroup"|"plugin"]``),
  or ``as-gloo`` (``BACKEND`` is ``gloo``, so every gloo-gated test runs, and
  ``init_process_group``/``new_group``/``new_subgroups*`` are wrapped so that the backend ``gloo``
  in their argument, or none given to ``init_process_group``, becomes ``collective``);
- ``COLLECTIVE_TORCH_SUITE_START``: ``spawn`` (torch's way: each process imports torch and this
  module afresh) or ``fork`` (each process a fork of the runner, which already imported them:
  seconds faster per test; torch's former test_distributed_fork ran the suite so);
- ``COLLECTIVE_TORCH_SUITE_TIMEOUT``: a cap, in seconds, on torch's per-test wall-clock limit
  (``common_distributed.get_timeout``: 300 s, some tests more); past it the spawned processes
  are terminated and the test errors with "terminated or timed out".
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from typing import Any

MODES = ("gloo", "collective", "as-gloo")
MODE = os.environ.get("COLLECTIVE_TORCH_SUITE_MODE", "")
START = os.environ.get("COLLECTIVE_TORCH_SUITE_START", "spawn")
if MODE not in MODES:
    raise RuntimeError(
        f"COLLECTIVE_TORCH_SUITE_MODE is {MODE!r}, one of {MODES} expected "
        "(run python -m tests.torch_suite.run)"
    )

torch: Any = importlib.import_module("torch")
dist: Any = importlib.import_module("torch.distributed")
c10d: Any = importlib.import_module("torch.distributed.distributed_c10d")
common: Any = importlib.import_module("torch.testing._internal.common_distributed")

OURS = "collective"
_GLOO = re.compile(r"\bgloo\b", re.IGNORECASE)


def as_ours(backend: Any) -> Any:
    """The backend argument with gloo replaced by ours ("gloo", Backend.GLOO, "cpu:gloo,cuda:nccl")."""
    if isinstance(backend, str):
        return _GLOO.sub(OURS, str(backend))
    return backend


def _rerouted(original: Callable[..., Any], none_is_gloo: bool) -> Callable[..., Any]:
    """``original`` (a function with a ``backend`` parameter) creating its groups with our backend
    where it was asked for gloo (or, ``none_is_gloo``, for no backend: torch's default on CPU)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if backend is None and none_is_gloo:
            bound.arguments["backend"] = OURS
        else:
            bound.arguments["backend"] = as_ours(backend)
        return original(*bound.args, **bound.kwargs)

    wrapper.__collective_rerouted__ = True  # type: ignore[attr-defined]
    return wrapper


def reroute_gloo() -> None:
    """Every group asked of gloo is created with our backend (in this process)."""
    replaced: dict[int, Any] = {}
    for name, none_is_gloo in (
        ("init_process_group", True),
        ("new_group", False),
        ("new_subgroups", False),
        ("new_subgroups_by_enumeration", False),
    ):
        original = getattr(c10d, name)
        if getattr(original, "__collective_rerouted__", False):
            continue
        replaced[id(original)] = _rerouted(original, none_is_gloo)
        setattr(c10d, name, replaced[id(original)])
    # modules that imported the functions by name before this point (torch.distributed itself,
    # device_mesh, ...): the wrapped ones there too
    for module in list(sys.modules.values()):
        if module is None or not getattr(module, "__name__", "").startswith("torch"):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in replaced and callable(value):
                setattr(module, attribute, replaced[id(value)])


def cap_timeouts(cap: float) -> None:
    """No test of the suite runs longer than ``cap`` seconds (torch's own limits below it stay)."""
    common.TIMEOUT_DEFAULT = min(common.TIMEOUT_DEFAULT, cap)
    for name, limit in list(common.TIMEOUT_OVERRIDE.items()):
        common.TIMEOUT_OVERRIDE[name] = min(limit, cap)


if MODE in ("collective", "as-gloo"):
    importlib.import_module("collective.torch")  # registers the backend "collective"
if MODE == "collective":
    for feature in ("ddp", "subgroup", "plugin"):
        common.DistTestCases.backend_feature[feature].add(OURS)
if MODE == "as-gloo":
    reroute_gloo()
if os.environ.get("COLLECTIVE_TORCH_SUITE_TIMEOUT"):
    cap_timeouts(float(os.environ["COLLECTIVE_TORCH_SUITE_TIMEOUT"]))

distributed_test: Any = importlib.import_module("torch.testing._internal.distributed.distributed_test")
DistributedTest = distributed_test.DistributedTest
TestDistBackend = distributed_test.TestDistBackend

REAP_SECONDS = 10.0


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc, valid-type]
    """torch's ``test/distributed/test_distributed_spawn.py`` class: each test spawns WORLD_SIZE
    processes that init the default group (file:// store) and run it. Every process it spawned is
    reaped at tearDown (killed if still alive ``REAP_SECONDS`` after torch terminated it)."""

    def setUp(self) -> None:
        super().setUp()
        if START == "fork":
            self._start_processes(torch.multiprocessing.get_context("fork").Process)
        else:
            self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def tearDown(self) -> None:
        spawned = list(getattr(self, "processes", []))
        try:
            super().tearDown()
        finally:
            for process in spawned:
                process.join(REAP_SECONDS)
                if process.exitcode is None:
                    process.kill()
                    process.join()
