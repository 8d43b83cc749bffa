"""The public worker entry point; the body lives in `elastic_mnist.worker.train`.

    torchrun --nnodes=1:4 --rdzv-backend=etcd-v3 ... -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun
"""

if __name__ == "__main__":
    # Before torch loads (seconds on a busy node): a SIGTERM from here on is a graceful stop (worker/stop.py).
    from elastic_mnist.worker.stop import install_early

    install_early()

from elastic_mnist.worker.train import launch, main  # noqa: E402 - after the early stop handler above

__all__ = ["launch", "main"]

if __name__ == "__main__":
    launch()
