"""Setting a job up: peer ids from the environment, the node address, devices, the demo command."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import collective as col
from collective.arrays import Device
from tests.conftest import RUN_SETTINGS

DOCS = Path(__file__).parent.parent / "docs"


@pytest.mark.parametrize("value", [None, "", " "], ids=["unset", "empty", "blank"])
def test_peer_ids_from_env_names_the_variable_when_it_is_missing(value: str | None) -> None:
    environ = {} if value is None else {"COLLECTIVE_PEER_IDS": value}
    with pytest.raises(
        col.ConfigError, match="COLLECTIVE_PEER_IDS is not set: it names this node's peer ids"
    ):
        col.peer_ids_from_env(environ)


@pytest.mark.parametrize("value", ["a,b", "1,1", "-1", ","])
def test_peer_ids_from_env_refuses_what_is_not_a_list_of_peer_ids(value: str) -> None:
    with pytest.raises(col.ConfigError, match=f"COLLECTIVE_PEER_IDS={value!r} is not a comma-separated"):
        col.peer_ids_from_env({"COLLECTIVE_PEER_IDS": value})


def test_peer_ids_from_env_reads_a_list() -> None:
    assert col.peer_ids_from_env({"COLLECTIVE_PEER_IDS": "2, 3,"}) == [2, 3]


def test_the_documented_node_script_fails_clearly_without_its_peer_ids(tmp_path: Path) -> None:
    """docs/multinode.md's script did nothing and exited 0 when COLLECTIVE_PEER_IDS was unset."""
    text = (DOCS / "multinode.md").read_text()
    scripts = [s for s in re.findall(r"```python\n(.*?)```", text, re.S) if "peer_ids_from_env" in s]
    assert scripts, "docs/multinode.md shows no node script with thread peers"
    path = tmp_path / "train.py"
    path.write_text(scripts[0])
    env = {k: v for k, v in os.environ.items() if k in RUN_SETTINGS or not k.startswith("COLLECTIVE_")}
    env.update(
        COLLECTIVE_NUM_DEVICES="1",
        COLLECTIVE_NUM_NODES="2",
        COLLECTIVE_GLOBAL_ADDRESS="127.0.0.1:9",
        COLLECTIVE_NODE_ADDRESS="127.0.0.1:0",
        COLLECTIVE_DATA_SERVICE_PORT="0",
        COLLECTIVE_TIMEOUT="1",
    )
    result = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode != 0
    assert "ConfigError: COLLECTIVE_PEER_IDS is not set" in result.stderr, result.stderr


def _multi_node(node_address: str, data_service_port: int) -> col.CollectiveConfig:
    return col.CollectiveConfig(
        num_nodes=2,
        global_address="127.0.0.1:29500",
        node_address=node_address,
        data_service_port=data_service_port,
    )


def test_a_node_address_port_other_than_the_data_service_port_is_refused() -> None:
    with pytest.raises(
        col.ConfigError, match=r"node_address '10\.0\.0\.5:6000' names port 6000 but data_service_port"
    ):
        _multi_node("10.0.0.5:6000", 0)
    assert _multi_node("10.0.0.5:6000", 6000).node_host == "10.0.0.5"
    assert _multi_node("10.0.0.5:0", 6000).data_service_port == 6000


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy that reports one CUDA device."""
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1)
    monkeypatch.setitem(
        sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime))
    )


def test_gpu_is_not_a_device_name() -> None:
    with pytest.raises(col.RegistrationError, match="unknown device 'gpu': use 'cpu' or 'cuda:N'"):
        Device.parse("gpu")
    with col.Runtime() as rt, pytest.raises(col.RegistrationError, match="unknown device 'gpu:1'"):
        rt.register(0, "gpu:1", col.CollectiveConfig())


@pytest.mark.parametrize("device", ["cuda:0", "cuda", 0, Device("cuda", 0)])
def test_a_cuda_device_needs_cupy(device: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(col.RegistrationError, match="needs CuPy, which cannot be imported here"):
        Device.parse(device)
    with col.Runtime() as rt, pytest.raises(col.RegistrationError, match="needs CuPy"):
        rt.register(0, device, col.CollectiveConfig())


@pytest.mark.usefixtures("one_gpu")
def test_a_cuda_device_must_exist() -> None:
    assert Device.parse("cuda:0") == Device("cuda", 0) == Device.parse(0)
    with pytest.raises(
        col.RegistrationError, match=r"device 'cuda:1': this machine has 1 CUDA device \(cuda:0"
    ):
        Device.parse("cuda:1")
    with pytest.raises(col.RegistrationError, match="device 3: this machine has 1 CUDA device"):
        Device.parse(3)


def test_the_demo_refuses_bad_arguments_as_usage_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "collective", "demo", "--peers", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "argument --peers: must be >= 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr
