"""The torch.distributed backend "collective" against gloo, in the same processes and the same run.

``python -m collective.bench.torch_backend.calls``: send/recv round trips and all_reduce by dtype;
``python -m collective.bench.torch_backend.pipeline``: pipeline-parallel training steps (1F1B, GPipe).
"""
