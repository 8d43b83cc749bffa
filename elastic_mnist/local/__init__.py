"""`elastic-mnist local`: an embedded etcd plus N torchrun nodes on this machine, fault injection, a live view.

    elastic-mnist local --nodes 2 --chaos 'kill:n1@step=150,join@step=300' --data-dir ../shared/data
"""
