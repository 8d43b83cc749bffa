"""The public worker entry point; the body lives in `elastic_mnist.worker.train`.

    torchrun --nnodes=1:4 --rdzv-backend=etcd-v3 ... -m elastic_mnist.train --data-dir DATA --checkpoint-dir CKPT
    python -m elastic_mnist.train --data-dir ../shared/data --epochs 1      # one process, no torchrun
"""

if __name__ == "__main__":
    # Before torch loads (seconds on a busy node): a SIGTERM from here on is a graceful stop (worker/stop.py).
    from elastic_mnist.warm import handoff
    from elastic_mnist.worker.stop import install_early

    install_early()
    # Under an etcd-v3 agent: run as a fork of its warm process (torch already imported) and stand in for it
    # until it exits; otherwise this returns and the worker starts cold (elastic_mnist/warm).
    handoff(preload=("elastic_mnist.worker.train",))

from elastic_mnist.worker.train import launch, main  # noqa: E402 - after the early stop handler above

__all__ = ["launch", "main"]

if __name__ == "__main__":
    launch()
