"""The public task API (`elastic_mnist.task.Task`); the body lives in `elastic_mnist.worker.task`.

    python -c "from elastic_mnist.task import MnistMLP; print(MnistMLP.name)"
"""

from elastic_mnist.worker.task import MnistMLP, Task

__all__ = ["MnistMLP", "Task"]
