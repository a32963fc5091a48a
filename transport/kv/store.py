"""Key-value stores the orchestrator serves: what torchrun's agents meet through (``--rdzv-backend
collective``, collective.torch.rendezvous) instead of a TCPStore on one of their hosts.

A store is named (its clients put the name in each message's ``job``) and made by its first
request; keys are strings, values bytes. The operations are those of torch.distributed's stores:

  kv {id, op: "set", keys, values}                -> kv {id}
  kv {id, op: "get", keys, wait}                  -> kv {id, values}      (once every key is set)
  kv {id, op: "add", keys: [key], amount}         -> kv {id, value}       (the sum, an int)
  kv {id, op: "compare_set", keys: [key], expected, desired}
                                                  -> kv {id, value}       (the value now)
  kv {id, op: "check", keys}                      -> kv {id, value}       (every key set: bool)
  kv {id, op: "delete", keys: [key]}              -> kv {id, value}       (it was set: bool)
  kv {id, op: "count"}                            -> kv {id, value}       (keys in the store)
  kv {id, op: "wait", keys, wait}                 -> kv {id}              (once every key is set)
  (any)                                           -> kv {id, error}       (timeout, full, malformed)

``get`` and ``wait`` hold their answer until every key is set or ``wait`` seconds passed (then an
error naming the keys missing). A store holds at most ``STORE_BYTES`` of keys and values, and one
nobody asked anything for ``STORE_IDLE`` seconds is dropped (its agents, alive, ask every few
seconds: torch's rendezvous keep-alive).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STORE_BYTES", "STORE_IDLE", "Stores"]

STORE_BYTES = 64 << 20
STORE_IDLE = 3600.0
MOST_WAIT = 24 * 3600.0  # the longest a get or wait may be held (seconds)
MOST_HELD = 4096  # answers held at once, every store together


@dataclass
class _Held:
    """A get or wait whose keys are not all set yet, answered when they are or at ``deadline``."""

    identity: bytes
    store: str
    message_id: Any
    op: str
    keys: list[str]
    deadline: float


@dataclass
class _Store:
    values: dict[str, bytes] = field(default_factory=dict)
    size: int = 0
    used: float = field(default_factory=time.monotonic)

    def growth(self, key: str, value: bytes) -> int:
        """How many bytes setting ``key`` to ``value`` adds."""
        old = self.values.get(key)
        return len(value) - len(old) if old is not None else len(key.encode()) + len(value)

    def put(self, key: str, value: bytes) -> None:
        self.size += self.growth(key, value)
        self.values[key] = value


Answer = tuple[bytes, dict[str, Any]]  # (routing id, message) to send


class Stores:
    """Every store of one orchestrator and the answers held for them (one thread: the orchestrator's)."""

    def __init__(self, most_bytes: int = STORE_BYTES, idle: float = STORE_IDLE) -> None:
        self._stores: dict[str, _Store] = {}
        self._held: list[_Held] = []
        self._most_bytes = most_bytes
        self._idle = idle

    def handle(self, identity: bytes, message: dict[str, Any]) -> list[Answer]:
        """The answers ``message`` (a ``kv`` from ``identity``) makes: its own unless held, and
        those of held gets and waits it completes."""
        name, message_id = message["job"], message.get("id")
        store = self._stores.get(name)
        if store is None:
            store = self._stores[name] = _Store()
        store.used = time.monotonic()
        try:
            value, changed = self._apply(identity, name, store, message)
        except _Refused as refused:
            return [(identity, {"t": "kv", "job": name, "id": message_id, "error": str(refused)})]
        answers: list[Answer] = []
        if value is not _HELD:
            reply = {"t": "kv", "job": name, "id": message_id}
            if value is not None:
                reply["value" if message["op"] != "get" else "values"] = value
            answers.append((identity, reply))
        if changed:
            answers.extend(self._release(name, store))
        return answers

    def expire(self) -> list[Answer]:
        """Errors for the held answers whose time is up; and stores idle too long dropped."""
        now = time.monotonic()
        late = [held for held in self._held if held.deadline <= now]
        if late:
            self._held = [held for held in self._held if held.deadline > now]
        answers = []
        for held in late:
            store = self._stores.get(held.store)
            missing = [key for key in held.keys if store is None or key not in store.values]
            answers.append(
                (
                    held.identity,
                    {
                        "t": "kv",
                        "job": held.store,
                        "id": held.message_id,
                        "error": f"timeout: {_listed(missing)} still not set in store {held.store!r}",
                    },
                )
            )
        for name, store in list(self._stores.items()):
            if now - store.used > self._idle and not any(held.store == name for held in self._held):
                del self._stores[name]
        return answers

    def forget(self, identity: bytes) -> None:
        """The connection of ``identity`` closed: nobody waits for its held answers."""
        self._held = [held for held in self._held if held.identity != identity]

    def names(self) -> list[str]:
        return list(self._stores)

    def _apply(self, identity: bytes, name: str, store: _Store, message: dict[str, Any]) -> tuple[Any, bool]:
        """(the answer's value, or None, or _HELD; whether a key was set)."""
        op, keys = message.get("op"), message.get("keys", [])
        if not isinstance(keys, list) or not all(isinstance(key, str) for key in keys):
            raise _Refused("malformed request: keys must be a list of strings")
        if op in ("get", "wait"):
            wait = message.get("wait", 0)
            if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MOST_WAIT:
                raise _Refused(f"malformed request: wait must be 0 to {MOST_WAIT:g} seconds")
            if all(key in store.values for key in keys):
                return ([store.values[key] for key in keys] if op == "get" else None), False
            if len(self._held) >= MOST_HELD:
                raise _Refused(f"busy: {MOST_HELD} gets and waits are held already")
            self._held.append(_Held(identity, name, message.get("id"), op, keys, time.monotonic() + wait))
            return _HELD, False
        if op == "set":
            values = message.get("values")
            if not isinstance(values, list) or len(values) != len(keys):
                raise _Refused("malformed request: set needs one value per key")
            for key, value in zip(keys, values, strict=True):
                self._put(name, store, key, _bytes(value))
            return None, bool(keys)
        if op == "count":
            return len(store.values), False
        if op == "check":
            return all(key in store.values for key in keys), False
        if len(keys) != 1:
            raise _Refused(f"malformed request: {op!r} takes one key" if isinstance(op, str) else "no op")
        key = keys[0]
        if op == "add":
            amount = message.get("amount")
            if not isinstance(amount, int) or isinstance(amount, bool):
                raise _Refused("malformed request: add needs an integer amount")
            try:
                total = int(store.values.get(key, b"0")) + amount
            except ValueError:
                raise _Refused(f"key {key!r} holds no integer: add cannot add to it") from None
            self._put(name, store, key, str(total).encode())
            return total, True
        if op == "compare_set":  # (torch's: a missing key counts as b"" and answers ``expected``)
            expected, desired = _bytes(message.get("expected")), _bytes(message.get("desired"))
            current = store.values.get(key)
            if current is None and expected:
                return expected, False
            if (current or b"") == expected:
                self._put(name, store, key, desired)
                return desired, True
            return current, False
        if op == "delete":
            old = store.values.pop(key, None)
            if old is not None:
                store.size -= len(key.encode()) + len(old)
            return old is not None, False
        raise _Refused(f"malformed request: unknown op {op!r}")

    def _put(self, name: str, store: _Store, key: str, value: bytes) -> None:
        if store.size + store.growth(key, value) > self._most_bytes:
            raise _Refused(
                f"full: store {name!r} holds {store.size} bytes, at most {self._most_bytes}; "
                f"it is meant for rendezvous, not data"
            )
        store.put(key, value)

    def _release(self, name: str, store: _Store) -> list[Answer]:
        """Answer the held gets and waits of store ``name`` whose keys are all set now."""
        ready = [
            held
            for held in self._held
            if held.store == name and all(key in store.values for key in held.keys)
        ]
        if not ready:
            return []
        self._held = [held for held in self._held if held not in ready]
        answers: list[Answer] = []
        for held in ready:
            reply: dict[str, Any] = {"t": "kv", "job": name, "id": held.message_id}
            if held.op == "get":
                reply["values"] = [store.values[key] for key in held.keys]
            answers.append((held.identity, reply))
        return answers


class _Refused(Exception):
    """A request the store answers with an error."""


_HELD = object()


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    raise _Refused("malformed request: values must be bytes or strings")


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(key) for key in keys[:4])
    return f"key {shown}" if len(keys) == 1 else f"keys {shown}" + (" and more" if len(keys) > 4 else "")
