"""Key-value stores the orchestrator serves: ``store`` (its side: collective.transport.kv.store)
and ``client`` (a connection to one, shared by threads: collective.transport.kv.client)."""
