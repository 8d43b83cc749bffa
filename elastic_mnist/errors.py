"""The one exception type for bad user input: the CLI prints it as a single line, no traceback."""


class UserError(Exception):
    """A problem the user can fix (bad flag, missing data, unreachable etcd); the message names the fix."""
