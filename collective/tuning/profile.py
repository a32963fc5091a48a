"""Profiles: measured figures in a JSON file (``collective tune`` writes one; COLLECTIVE_PROFILE
names the one a job reads).

The file::

    {"schema": "collective-profile", "version": 1,
     "created": "2026-11-27T19:00:00Z", "host": "node-a", "command": "collective tune ...",
     "curves": [{"transport": "zmq", "kind": "all_reduce", "participants": 2, "hosts": 2,
                 "local": 1, "strategy": "ring", "points": [[131072, 0.00226], ...]}, ...]}

``load`` checks everything (the schema and version, every field's type and range, the sizes
ascending, the times finite and > 0) and raises ProfileError naming the first problem: a job
then warns and measures for itself (collective.tuning.probe), it never runs on a bad file.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from collective.algorithms.strategies import Auto, parse_strategy
from collective.config import KINDS
from collective.errors import CollectiveError, ConfigError
from collective.tuning.model import Curve, Figures, Key

__all__ = ["SCHEMA", "VERSION", "ProfileError", "ProfileWarning", "dump", "load", "parse", "read", "save"]

SCHEMA = "collective-profile"
VERSION = 1
TRANSPORT_NAMES = ("inproc", "zmq")
MAX_BYTES = 8 << 20  # a profile is a few KiB; refuse to read a huge file


class ProfileError(CollectiveError):
    """A profile that cannot be used: unreadable, not JSON, another schema or version, bad values."""


class ProfileWarning(UserWarning):
    """A profile was refused (the job measures for itself instead)."""


def load(path: str) -> Figures:
    """The figures of the profile at ``path``; raises ProfileError naming the problem."""
    return parse(read(path), path)


def read(path: str) -> bytes:
    """The text of the profile at ``path`` (at most MAX_BYTES); raises ProfileError."""
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"profile {path}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > MAX_BYTES:
        raise ProfileError(f"profile {path}: larger than {MAX_BYTES} bytes, not a profile")
    return data


def parse(data: bytes | str, where: str = "profile") -> Figures:
    """Figures from a profile's text; raises ProfileError."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProfileError(f"{where}: not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("schema") != SCHEMA:
        raise ProfileError(f'{where}: not a collective profile (no "schema": "{SCHEMA}")')
    if document.get("version") != VERSION:
        raise ProfileError(
            f"{where}: profile version {document.get('version')!r}, this collective reads version {VERSION}: "
            f"write a new one with collective tune"
        )
    curves = document.get("curves")
    if not isinstance(curves, list) or not curves:
        raise ProfileError(f'{where}: "curves" must be a non-empty list')
    figures = Figures("profile")
    for index, entry in enumerate(curves):
        try:
            key, strategy, curve = _curve(entry)
        except (ValueError, TypeError, ConfigError) as exc:
            raise ProfileError(f"{where}: curves[{index}]: {exc}") from None
        if (key, strategy) in figures.curves:
            raise ProfileError(f"{where}: curves[{index}]: {strategy} at {key.describe()} ({key.kind}) twice")
        figures.curves[(key, strategy)] = curve
    return figures


def _curve(entry: Any) -> tuple[Key, str, Curve]:
    if not isinstance(entry, dict):
        raise ValueError("must be an object")
    transport, kind = entry.get("transport"), entry.get("kind")
    if transport not in TRANSPORT_NAMES:
        raise ValueError(f"transport must be one of {', '.join(TRANSPORT_NAMES)}, got {transport!r}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    counts = []
    for name in ("participants", "hosts", "local"):
        value = entry.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
            raise ValueError(f"{name} must be an integer in 1..{1 << 20}, got {value!r}")
        counts.append(value)
    text = entry.get("strategy")
    if not isinstance(text, str):
        raise ValueError(f"strategy must be a string, got {text!r}")
    strategy = parse_strategy(text)
    if isinstance(strategy, Auto):
        raise ValueError("strategy 'auto' names no schedule")
    points = entry.get("points")
    if not isinstance(points, list) or not points or len(points) > 64:
        raise ValueError("points must be a list of 1 to 64 [bytes, seconds] pairs")
    pairs = []
    for point in points:
        if not (isinstance(point, list) and len(point) == 2):
            raise ValueError(f"a point must be [bytes, seconds], got {point!r}")
        size, seconds = point
        if isinstance(size, bool) or not isinstance(size, int) or isinstance(seconds, bool):
            raise ValueError(f"a point must be [integer bytes, seconds], got {point!r}")
        if not isinstance(seconds, int | float):
            raise ValueError(f"a point's seconds must be a number, got {seconds!r}")
        pairs.append((size, float(seconds)))
    return Key(transport, kind, *counts), str(strategy), Curve(tuple(pairs))


def dump(figures: Figures, command: str = "") -> str:
    """The profile text of ``figures``."""
    curves = [
        {
            "transport": key.transport,
            "kind": key.kind,
            "participants": key.participants,
            "hosts": key.hosts,
            "local": key.local,
            "strategy": strategy,
            "points": [[size, float(f"{seconds:.6g}")] for size, seconds in curve.points],
        }
        for (key, strategy), curve in sorted(figures.curves.items())
    ]
    head = {
        "schema": SCHEMA,
        "version": VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": socket.gethostname(),
        "command": command,
    }
    lines = [f" {json.dumps(name)}: {json.dumps(value)}," for name, value in head.items()]
    body = ",\n".join(f"  {json.dumps(curve)}" for curve in curves)
    return "{\n" + "\n".join(lines) + '\n "curves": [\n' + body + "\n ]\n}\n"


def save(figures: Figures, path: str, command: str = "") -> None:
    """Write ``figures`` to ``path`` (atomically: a reader sees the old file or the new one)."""
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as file:
        file.write(dump(figures, command))
    os.replace(temporary, path)
