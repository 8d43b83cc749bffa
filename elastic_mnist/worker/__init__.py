"""The worker: the step loop and what it trains (trainer, task, model, optimizer, per-step agreement).

    torchrun ... -m elastic_mnist.train ...     # the public entry; its body is worker/train.py
"""
