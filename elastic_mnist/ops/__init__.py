"""Operator tools: the Kubernetes pod's entry process, the node preflight check, `elastic-mnist status`.

    elastic-mnist status --rdzv-endpoint HOST:2379 --rdzv-id JOB --checkpoint-dir CKPT
"""
