"""elastic-mnist: fault-tolerant elastic DDP training of MNIST under torchrun.

    torchrun --nnodes=1:4 --rdzv-backend=etcd ... -m elastic_mnist.train --data-dir DATA
"""

__version__ = "0.1.0"
