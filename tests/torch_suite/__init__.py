"""PyTorch's own distributed test suite (``DistributedTest._DistTestBase``) run against a backend.

``python -m tests.torch_suite.run --backend collective|gloo --world-size N [--as-gloo]``: see
``tests/torch_suite/run.py`` for how, and ``tests/torch_suite/suite.py`` for the test class the
spawned processes run.
"""
