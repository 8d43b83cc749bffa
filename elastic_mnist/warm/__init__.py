"""Warm worker starts: every membership change restarts every worker, and most of a restart is importing
torch. With the etcd-v3 backend each torchrun agent keeps one warm process beside it (torch and the
trainer imported once, no thread, no CUDA); a worker that torchrun starts hands its command to it and
the warm process fork()s a child that runs it with the worker's environment, descriptors and signals.

    torchrun --rdzv-backend=etcd-v3 ... -m elastic_mnist.train ...   # on by default
    torchrun --rdzv-backend=etcd-v3 --rdzv-conf=warm_start=0 ...      # every worker starts cold

The process torchrun started stays as the child's stand-in: it forwards every signal it gets, reports the
child's exit status as its own, and when it is killed the child dies with it. Nothing here imports torch:
the stand-in must start in milliseconds. Your own script opts in with two lines before `import torch`:

    from elastic_mnist.warm import handoff
    handoff(preload=("torch", "elastic_mnist.train"))
"""

from elastic_mnist.warm.handoff import handoff

__all__ = ["handoff"]
