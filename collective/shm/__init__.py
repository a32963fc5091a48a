"""Shared memory among the processes of one host: the steps of a group through its members' ring
segments, as a typed primitive any executor drives with a task (collective.executors.shm for a
collective's own steps, collective.executors.host_tier for a host's part of a larger one).

* ``group``: ``ShmGroup`` (publish, meet, agree, small steps inline, large ones chunked) and the
  ``ShmTask`` it runs;
* ``chunks``: the chunk pipeline's primitives (reduce, copy, stack, split) the movement families drive;
* ``ring``: this process's ring of a job (its segment, the others', its channels) and the codec of
  a call in a slot.
"""
