"""The embedded etcd server, least-privilege auth set-up, and the `elastic-mnist etcd` command.

    elastic-mnist etcd --port 2379
"""
