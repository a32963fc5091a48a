"""Microbenchmarks for the collective runtime (``collective bench``) and the baselines they compare with."""
