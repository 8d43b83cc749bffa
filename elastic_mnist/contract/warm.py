"""How a torchrun agent starts its warm process and hears from it: the module it runs, where it listens, the
progress marks it writes, and the worker it may build before its round (WorkerPlan); and the messages the warm
process, the stand-ins and the workers it forked say to each other (warm/_wire.py frames them).

    python -c "from elastic_mnist.contract.warm import WorkerPlan; print(WorkerPlan({'module': 'm'}, [], '/', 1))"

The agent's side is rendezvous/_warm_start.py, the warm process's warm/server.py; neither imports the other.
"""

from __future__ import annotations

import os

SERVER_MODULE = "elastic_mnist.warm.server"  # `python -m` this, with the flags warm/server.py declares
TRAIN_MODULE = "elastic_mnist.train"  # the package's own worker: its flags can be checked before it starts
SOCKET_NAME = "warm.sock"
MAX_PATH = 100  # sun_path holds 108 bytes: a longer agent directory gets no warm process
PROBE_TIMEOUT_S = 20.0  # how long a probe child may take to prove a fork of the warm process runs torch
# One byte each on the agent's pipe: listening, warm (torch imported, a fork proven safe), ready (each local
# rank's worker built before its round), failed (such a worker ended first).
LISTENING, WARM, READY, FAILED = b"1", b"2", b"3", b"x"


def address_in(directory: str) -> str:
    return os.path.join(directory, SOCKET_NAME)


class Record:
    """A frozen value whose fields are its class's annotations, in order (a field with a class-level value has
    that default), compared and shown by value. Not dataclasses: a stand-in imports this module on every
    node at every membership change, and importing and applying dataclasses cost it about 20 ms of CPU, a
    third of its start (bench/ledger.py counts the stand-ins' CPU in a change)."""

    FIELDS: dict[str, str] = {}
    """Every field's name and its type as written (a string: `from __future__ import annotations`)."""

    def __init_subclass__(cls) -> None:
        cls.FIELDS = {**cls.FIELDS, **cls.__dict__.get("__annotations__", {})}

    def __init__(self, *args, **kwargs) -> None:
        names = list(self.FIELDS)
        if len(args) > len(names) or set(kwargs) - set(names[len(args):]):
            raise TypeError(f"{type(self).__name__}() takes the fields {', '.join(names) or 'none'}")
        values = {**dict(zip(names, args)), **kwargs}
        for name in names:
            if name not in values and not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__}() missing the field {name!r}")
            object.__setattr__(self, name, values.get(name, getattr(type(self), name, None)))

    def values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot set {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is frozen: cannot delete {name!r}")

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.values() == self.values()

    def __hash__(self) -> int:
        return hash((type(self), self.values()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={v!r}' for n, v in zip(self.FIELDS, self.values()))})"


class WorkerPlan(Record):
    """The worker a torchrun agent will start, as its command line says (its warm process may build it first)."""

    target: dict
    """{"module": name} or {"path": absolute script path}, as a stand-in's request names it."""
    args: list
    cwd: str
    local_world_size: int

    def to_json(self) -> dict:
        return dict(zip(self.FIELDS, self.values()))

    @classmethod
    def from_json(cls, data: dict) -> WorkerPlan:
        return cls(dict(data["target"]), list(data["args"]), str(data["cwd"]), int(data["local_world_size"]))


class Request(Record):
    """What a stand-in sends first: the worker torchrun started it as, all a fork of the warm process needs to
    become that worker (warm/become.py). warm/_wire.py checks the values before anything is forked."""

    exe: str
    """sys.executable: the warm process serves its own interpreter only"""
    version: str
    argv: list
    path: list
    """sys.path"""
    cwd: str
    env: dict
    target: dict
    """{"module": name} or {"path": absolute script path}"""
    preload: list
    """modules its script names in handoff(preload=...)"""
    started: float
    """time.time() when the stand-in started"""
    unbuffered: bool
    settings: dict
    """its process settings (warm/settings.py); {} for a worker built before its round"""
    token: str = ""
    """the agent's token, carried by its stand-ins only (never by a kept worker's Attach)"""

    def to_json(self) -> dict:
        data = dict(zip(self.FIELDS, self.values()))
        if not self.token:
            del data["token"]
        return data

    @classmethod
    def from_json(cls, data: object) -> Request:
        """The request a JSON object holds; ValueError naming the first field missing or of another type."""
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        values = {}
        for name, written in cls.FIELDS.items():
            kind = _TYPES[written]
            value = data.get(name, "" if name == "token" else None)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise ValueError(f"{name!r} missing or not a {getattr(kind, '__name__', 'number')}")
            values[name] = value
        return cls(**values)

    @staticmethod
    def take_token(data: object) -> str:
        """The token a request's JSON object carries ("" if none), taken out of it: checked before anything
        else of the request is read, and never handed on (a kept worker's Attach carries none)."""
        return str(data.pop("token", "")) if isinstance(data, dict) else ""


_TYPES = {"str": str, "list": list, "dict": dict, "float": (int, float), "bool": bool}


# The warm wire's messages. On the wire each is a JSON object with one key, its kind, whose value is the one
# field (true for those without one): {"pid": 123}, {"applied": true}. A stand-in first sends its request (a
# JSON object of its own, warm/_wire.py), then hears Pid, Exit or Refused.
class Pid(Record):
    """warm process to stand-in: this worker takes your round; wait for its Exit."""

    pid: int


class Exit(Record):
    """warm process to stand-in: exit with this code (the worker's, or its Detach's: the round is over)."""

    code: int


class Refused(Record):
    """No: to a stand-in, start cold (and say why); from a worker, it cannot take the settings or the round."""

    why: str


# A forked worker's side of its socketpair with the warm process:
class Applied(Record):
    """worker to warm process: the stand-in's process settings hold; its round may start."""


class Ready(Record):
    """worker to warm process: built before its round (a joiner's agent may join now)."""


class Attach(Record):
    """warm process to a kept worker: take this stand-in's round (its descriptors come with the message)."""

    request: Request


class Attached(Record):
    """kept worker to warm process: it took the round."""


class Detach(Record):
    """worker to warm process: the round is over, its stand-in exits with `code`; the worker stays."""

    code: int


class End(Record):
    """warm process to worker: its agent ends; save what it holds and exit."""

    why: str


Message = Pid | Exit | Refused | Applied | Ready | Attach | Attached | Detach | End
_KINDS: dict[str, type] = {"pid": Pid, "exit": Exit, "refused": Refused, "applied": Applied, "ready": Ready,
                           "attach": Attach, "attached": Attached, "detach": Detach, "end": End}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
MESSAGE_KINDS = tuple(_KINDS)


def encode(message: Message) -> dict:
    """The JSON object of a message."""
    values = message.values()
    value = values[0].to_json() if isinstance(message, Attach) else values[0] if values else True
    return {_KIND_OF[type(message)]: value}


def decode(data: object) -> Message:
    """The message a JSON object is; ValueError naming what is wrong with anything else."""
    if not isinstance(data, dict) or len(data) != 1:
        raise ValueError("a message that is not a JSON object with one key")
    (kind, value), = data.items()
    cls = _KINDS.get(kind)
    if cls is None:
        raise ValueError(f"a message of unknown kind {kind[:40]!r}")
    (written, *_rest) = cls.FIELDS.values() or (None,)
    if written is None:
        if value is not True:
            raise ValueError(f"a {kind!r} message with a value")
        return cls()
    if cls is Attach:
        return Attach(Request.from_json(value))
    want = {"int": int, "str": str}[written]
    if not isinstance(value, want) or isinstance(value, bool):
        raise ValueError(f"a {kind!r} message whose value is not a {want.__name__}")
    return cls(value)
