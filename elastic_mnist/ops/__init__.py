"""Operator tools: the Kubernetes pod's entry process, the node preflight check, `elastic-mnist status`,
the start watchdog (startwatch.py: standard library only, it runs from a stock Python image).

    elastic-mnist status --rdzv-endpoint HOST:2379 --rdzv-id JOB --checkpoint-dir CKPT
"""
