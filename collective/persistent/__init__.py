"""Persistent collectives: a call agreed once, then run again and again on the same buffers.

``handle``: ``Persistent``, one peer's handle (its uses, ``start``/``wait``, ``free``); ``kinds``:
``Persistents``, the Runtime's ``all_reduce_init`` and the others, which make one; ``kept``:
``KeptCalls``, the Runtime's normal calls that come again on the same arrays, run as uses;
``p2p``: ``PersistentSend`` and ``PersistentRecv``, a peer's persistent sends and receives (made
by collective.p2p's ``PersistentPoints``, the Runtime's ``send_init`` and ``recv_init``).
"""

from collective.persistent.handle import Persistent
from collective.persistent.kept import KeptCalls
from collective.persistent.kinds import Persistents

__all__ = ["KeptCalls", "Persistent", "Persistents"]
