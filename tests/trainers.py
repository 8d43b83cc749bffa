"""A Trainer in this process, built by the worker's own build_trainer (the code path of train.py), over
data a test hands in."""

from __future__ import annotations

import weakref
from contextlib import ExitStack

from elastic_mnist.distributed import DistEnv
from elastic_mnist.worker.build import build_trainer
from elastic_mnist.worker.control import ControlPlane
from elastic_mnist.worker.task import MnistMLP
from elastic_mnist.worker.trainer import Trainer


class GivenData(MnistMLP):
    """The MNIST MLP task over the given (train, test) splits instead of the files in --data-dir."""

    def __init__(self, train, test):
        self.splits = (train, test)

    def datasets(self, config):
        return self.splits


def in_process_trainer(config, train, test, env: DistEnv = DistEnv(), stop=None) -> Trainer:
    """Restored from config.checkpoint_dir when that holds a state; its files close with the trainer."""
    stack = ExitStack()
    trainer = build_trainer(config, env, GivenData(train, test), ControlPlane(env.world_size, config, stop), stack)
    weakref.finalize(trainer, stack.close)
    return trainer
