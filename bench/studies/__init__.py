"""Studies of one cost at a time, each run as ``python -m collective.bench.studies.NAME``:
``trace_overhead`` (what the flight recorder costs an 8 B all_reduce), ``host_tier`` (hosts of
several processes: the tier, the flat path and gloo), ``keeping`` (what keeping normal calls
costs and pays, on the same arrays and on new ones), ``thread_floor`` (thread peers against the
least any collective of threads costs here)."""
