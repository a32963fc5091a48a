"""The public surface is exactly the documented API."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import collective

DOCUMENTED = {
    "register",
    "all_reduce",
    "all_reduce_init",  # persistent collectives (collective.persistent)
    "broadcast_init",
    "all_gather_init",
    "reduce_scatter_init",
    "barrier_init",
    "Persistent",
    "send_init",  # persistent sends and receives (collective.persistent.p2p)
    "recv_init",
    "PersistentSend",
    "PersistentRecv",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "gather",
    "scatter",
    "barrier",
    "send",
    "recv",
    "recv_any",
    "all_reduce_coalesced",
    "finish",
    "reset",
    "all_gather_v",
    "reduce_scatter_v",
    "all_to_all_v",
    "default_runtime",
    "explain",
    "dump_trace",
    "stats",
    "Runtime",
    "new_group",
    "Group",
    "world_size",
    "Work",
    "init",
    "peer_ids_from_env",
    "CollectiveConfig",
    "Centralized",
    "Tree",
    "Ring",
    "Direct",
    "Auto",
    "Explanation",
    "ReduceOp",
    "CollectiveError",
    "ConfigError",
    "InvalidArgumentError",
    "RegistrationError",
    "MismatchError",
    "PeerLostError",
    "JobClosedError",
    "CollectiveTimeout",
}


def test_all_is_exactly_the_documented_api() -> None:
    assert set(collective.__all__) == DOCUMENTED
    assert len(collective.__all__) == len(DOCUMENTED)
    for name in collective.__all__:
        assert hasattr(collective, name)
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        collective.missing  # noqa: B018


def test_every_package_imports_on_its_own() -> None:
    """No import cycle: each package can be the first one imported (in a fresh interpreter)."""
    for module in (
        "collective.algorithms",
        "collective.transport.inproc",
        "collective.transport.zmq_link",
        "collective.errors",
        "collective.bench.sweep",
    ):
        result = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"import {module}: {result.stderr}"


def test_the_api_reference_covers_every_public_name() -> None:
    text = (pathlib.Path(__file__).parents[1] / "docs" / "api.md").read_text()
    missing = [name for name in collective.__all__ if not re.search(rf"`(col\.)?{name}\b", text)]
    assert not missing, f"docs/api.md does not document {missing}"


def test_error_hierarchy_keeps_builtin_bases() -> None:
    assert issubclass(collective.ConfigError, ValueError)
    assert issubclass(collective.InvalidArgumentError, ValueError)
    assert issubclass(collective.CollectiveTimeout, TimeoutError)
    for name in (
        "ConfigError",
        "InvalidArgumentError",
        "RegistrationError",
        "MismatchError",
        "PeerLostError",
        "JobClosedError",
        "CollectiveTimeout",
    ):
        assert issubclass(getattr(collective, name), collective.CollectiveError)


def test_init_is_the_function_whatever_is_imported() -> None:
    """``col.init`` stays the function when the module behind it (collective.launch.bootstrap) is imported."""
    code = (
        "import collective as col, collective.launch.bootstrap\n"
        "from collective.launch.bootstrap import init_with_store\n"
        "assert callable(col.init) and col.init is col.api.init, col.init\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_the_module_level_collectives_are_the_default_runtimes_methods() -> None:
    """No function of the module's own between a caller and the runtime: each call would make a
    frame, and the flight recorder walk past it, to find the caller's line."""
    runtime = collective.default_runtime()
    for name in ("all_reduce", "broadcast", "barrier", "send", "recv", "all_reduce_init", "finish"):
        method = getattr(collective, name)
        assert method.__self__ is runtime and method.__func__ is getattr(type(runtime), name), name


def test_the_module_level_functions_pickle_as_the_loading_processs_own() -> None:
    """As Ray sends a task that calls them: by reference, to the default runtime of the process
    that loads them (another Runtime, holding threads and sockets, does not pickle)."""
    import pickle

    sent = pickle.dumps([collective.all_reduce, collective.barrier_init])
    code = (
        "import pickle, sys, collective\n"
        "got = pickle.loads(sys.stdin.buffer.read())\n"
        "assert all(f.__self__ is collective.default_runtime() for f in got), got\n"
        "print('same', [f.__name__ for f in got])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], input=sent, capture_output=True, timeout=60)
    assert done.returncode == 0 and b"same ['all_reduce', 'barrier_init']" in done.stdout, done.stderr
    with pytest.raises(TypeError, match="only default_runtime"):
        pickle.dumps(collective.Runtime())
