"""The smallest real torchrun payload: a gloo all_reduce across whatever world the rendezvous formed.

    torchrun --nnodes=1:2 --nproc-per-node=1 --rdzv-backend=etcd-v3 --rdzv-endpoint=127.0.0.1:2379 \\
        --rdzv-id=smoke tests/rdzv_tiny_worker.py
"""

import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"rank {dist.get_rank()} world {dist.get_world_size()} sum {int(total.item())}", flush=True)
dist.destroy_process_group()
# gloo's threads may still be freeing the collective's tensors: an interpreter teardown that meets them
# aborts (SIGABRT). End as the worker does (elastic_mnist/worker/train.py launch).
os._exit(0)
