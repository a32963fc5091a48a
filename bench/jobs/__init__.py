"""Benchmark jobs of several processes: ours (``--nodes M``) and gloo (``--compare gloo``), on this
machine or inside emulated hosts (``--hosts H``, collective.bench.jobs.hosts).

``multinode`` starts the processes and collects their rows; ``node_worker`` and ``gloo_worker``
are the processes it starts; ``hosts`` makes the emulated hosts they may run in.
"""
