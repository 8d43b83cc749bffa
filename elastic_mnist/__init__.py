"""elastic-mnist: fault-tolerant elastic DDP training of MNIST under torchrun.

    torchrun --nnodes=1:4 --rdzv-backend=etcd ... -m elastic_mnist.train --data-dir DATA
"""

import os

__version__ = "0.1.0"

# gRPC (our etcd v3 client) runs fork handlers that restart its poller threads in a forked child; a
# child that subprocess then strips of its fds (close_fds, before exec) aborts with "epoll_wait error:
# Bad file descriptor" or hangs its parent. Our forked children exec at once or never use gRPC (DataLoader
# workers), so the handlers only do harm. gRPC reads this at import: this runs before any of our modules.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
