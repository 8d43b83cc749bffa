"""Operator tools: the Kubernetes pod's entry process, the node preflight check, `elastic-mnist status`,
the start watchdog (`elastic-mnist startwatch`: startwatch.py, its decisions in startrules.py and noderules.py, its
API calls in kubeapi.py; standard library only, so that its container stays small).

    elastic-mnist status --rdzv-endpoint HOST:2379 --rdzv-id JOB --checkpoint-dir CKPT
"""
