"""The call classes are the one list of collective kinds: the registry, the wire, the strategies
and the movement families all follow from them."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

from collective.algorithms.ops import ReduceOp
from collective.calls import CALLS, RULES, rules_of
from collective.calls.fields import signature_fields, signature_from_fields
from collective.calls.movement import Movement
from collective.calls.signature import Rules, Signature
from collective.config import KINDS, CollectiveConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("kind", sorted(CALLS))
def test_every_call_runs_a_configured_strategy_and_travels_on_the_wire(kind: str) -> None:
    cls = CALLS[kind]
    assert cls.kind == kind and RULES[kind] is cls.rules is rules_of(kind)
    assert cls.strategy_kind in KINDS or cls.strategy_kind == "all_reduce", cls.strategy_kind
    config = CollectiveConfig()
    assert config.local_strategy(cls.strategy_kind) == getattr(config, f"local_{cls.strategy_kind}_strategy")
    sent = Signature(kind, None, None, (3,), np.dtype(np.float32), sizes=(1, 2), table=((0, (3, -1)),))
    assert signature_from_fields(signature_fields(sent)) == sent


def test_no_executor_names_a_collective() -> None:
    """Executors, the shared-memory primitive and the nodes ask the call's movement; a collective's
    name appears in their code (not in docstrings or comments) nowhere."""
    names = set(CALLS)
    folders = [ROOT / "collective" / name for name in ("executors", "shm", "node")]
    for path in (p for folder in folders for p in folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        found = [
            node.value
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and node.value in names and id(node) not in docstrings
        ]
        assert not found, f"{path.relative_to(ROOT)} names {found}"


def test_an_unknown_kind_compares_nothing() -> None:
    assert rules_of("no such collective") == Rules(())


GATHERED_ROWS = {"all_gather_v": (1, -1), "all_to_all_v": (1, 1, -1)}  # what a rank states: sends, out rows


@pytest.mark.parametrize("kind", sorted(CALLS))
def test_every_call_says_how_its_data_moves(kind: str) -> None:
    """Every call class has a movement family for a plain agreed call of its kind."""
    cls = CALLS[kind]
    rules = cls.rules
    size = 2
    agreed = Signature(
        kind,
        ReduceOp.SUM if cls.reduces else None,
        0 if cls.rooted or rules.sourced else None,
        (size, 3),
        np.dtype(np.float32),
        sizes=(1, 1) if "sizes" in rules.compared else (),
        table=tuple((rank, GATHERED_ROWS[kind]) for rank in range(size)) if rules.gathered else (),
    )
    call = cls.refused("unused")
    assert isinstance(call.movement(agreed, size), Movement)
