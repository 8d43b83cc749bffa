"""The exception types for bad user input: the CLI prints them as a single line, no traceback."""


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, unreachable etcd); the message names the fix."""


class NodeLocalError(UserError):
    """A problem of this node only (its own directories, its /dev/shm, its device): another node may not have
    it, so it ends this node (exit 69, exit_codes.NODE_LOCAL) and never the job."""


class PeerNodeLocalError(RuntimeError):
    """Another rank of this round met a NodeLocalError while the round started: this rank has nothing to fix;
    the round ends (exit 75) and the next one forms without that node."""
