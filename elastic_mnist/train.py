"""The public worker entry point; the body lives in `elastic_mnist.worker.train`.

    torchrun --nnodes=1:4 --rdzv-backend=etcd-v3 ... -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun
"""

from elastic_mnist.worker.train import launch, main

__all__ = ["launch", "main"]

if __name__ == "__main__":
    launch()
