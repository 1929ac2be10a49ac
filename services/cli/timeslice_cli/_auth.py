"""``timeslice auth …``: make the operator's keys, issue credentials, write the server configuration, revoke.

    timeslice auth init [--dir D]
    timeslice auth job --job J [--group G ...] [--ttl 30d] --out FILE
    timeslice auth agent --node N --out FILE
    timeslice auth orchestrator|admin|reader|local --out FILE
    timeslice auth server-config [--dir D] [--out FILE]
    timeslice auth revoke [--dir D] (--user-key UPUB | --creds-file FILE)

``--dir`` defaults to ``$TIMESLICE_AUTH_DIR``, else ``~/.timeslice/auth``. Every file is written 0600 (the dir 0700);
what is printed names files and public keys, never a seed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from timeslice_orchestrator._auth_issue import AuthDir, AuthError, decode_jwt, parse_ttl, write_private

__all__ = ["default_auth_dir", "register"]


def default_auth_dir() -> Path:
    env = os.environ.get("TIMESLICE_AUTH_DIR")
    return Path(env).expanduser() if env else Path.home() / ".timeslice" / "auth"


def _dir(args: argparse.Namespace) -> Path:
    return Path(args.dir).expanduser() if args.dir else default_auth_dir()


def _init(args: argparse.Namespace) -> int:
    auth, created = AuthDir.init(_dir(args))
    conf = auth.write_server_config()
    what = "created" if created else "already there, reused (nothing overwritten)"
    print(
        f"auth dir {auth.path}: {what}; account {auth.account_key}; server config {conf} (load it with "
        f"`include {conf.name}` or `nats-server -c {conf}`)"
    )
    return 0


def _ttl(text: str) -> int:
    try:
        return parse_ttl(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _issue(args: argparse.Namespace) -> int:
    auth = AuthDir.load(_dir(args))
    ident = getattr(args, "job", None) or getattr(args, "node", None)
    issued = auth.issue(args.role, ident, groups=getattr(args, "group", None) or (), ttl_s=args.ttl)
    out = Path(args.out).expanduser()
    write_private(out, issued.creds())
    until = "no expiry" if issued.expires is None else f"expires at {issued.expires} (unix time)"
    print(f"{issued.name}: credentials written to {out} (mode 0600); user key {issued.user_key}; {until}")
    return 0


def _server_config(args: argparse.Namespace) -> int:
    auth = AuthDir.load(_dir(args))
    out = auth.write_server_config(Path(args.out).expanduser() if args.out else None)
    print(f"server config written to {out}; reload the servers to apply it (`nats-server --signal reload`)")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    auth = AuthDir.load(_dir(args))
    key = args.user_key
    if args.creds_file:
        text = Path(args.creds_file).expanduser().read_text()
        try:
            jwt = text.split("-----BEGIN NATS USER JWT-----", 1)[1].split("------END NATS USER JWT------", 1)[0]
        except IndexError:
            raise AuthError(f"{args.creds_file} is not a NATS .creds file", path=args.creds_file) from None
        key = str(decode_jwt(jwt, issuer=auth.account_key)["sub"])
    stamp = auth.revoke(key)
    print(
        f"revoked user {key} (every JWT of it issued up to {stamp}); server config {auth.path / 'nats-auth.conf'} "
        "rewritten: reload the servers to apply it (`nats-server --signal reload`, or restart `timeslice up`)"
    )
    return 0


def _cmd(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], Coroutine[Any, Any, int]]:
    """``fn`` as the coroutine function the ``timeslice`` command runs (these touch only local files)."""

    async def run(args: argparse.Namespace) -> int:
        return fn(args)

    return run


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=None, help="the auth dir (default $TIMESLICE_AUTH_DIR, else ~/.timeslice/auth)")


def _user(sub: Any, role: str, help_text: str) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(role, help=help_text)
    _common(p)
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="where to write the .creds file (mode 0600)")
    p.add_argument(
        "--ttl",
        type=_ttl,
        default=None,
        help="valid for this long (30d, 12h, 90m; default: no expiry; revoke with `timeslice auth revoke`)",
    )
    p.set_defaults(func=_cmd(_issue), role=role)
    return p


def register(sub: Any) -> None:
    """Add ``auth`` and its subcommands to the ``timeslice`` command's subparsers."""
    auth = sub.add_parser("auth", help="NATS identities: the operator's keys, credentials, server config")
    asub = auth.add_subparsers(dest="auth_command", required=True)
    init = asub.add_parser(
        "init",
        help="create the auth dir (operator, system account, TIMESLICE account) and "
        "its nats-server config; an existing one is reused",
    )
    _common(init)
    init.set_defaults(func=_cmd(_init))
    job = _user(asub, "job", "credentials of one job: its own requests, notices and workload commands only")
    job.add_argument("--job", required=True, help="the job id")
    job.add_argument(
        "--group",
        action="append",
        default=None,
        help="limit it to this group (repeat for several; default: every group)",
    )
    agent = _user(asub, "agent", "credentials of one node's snapshot agent")
    agent.add_argument("--node", required=True, help="the node id")
    _user(asub, "orchestrator", "credentials of the orchestrator (grants, revocations, agent commands)")
    _user(asub, "admin", "an operator: reads, and clears faults (clear-fault, agent-clear-fault)")
    _user(asub, "reader", "read-only: status, events, replay, check, agent-status")
    _user(asub, "local", "the single user of a `timeslice up` machine: every job and the admin")
    sc = asub.add_parser("server-config", help="write the nats-server config snippet again (after a revocation)")
    _common(sc)
    sc.add_argument("-o", "--out", default=None, metavar="FILE", help="where (default <dir>/nats-auth.conf)")
    sc.set_defaults(func=_cmd(_server_config))
    rv = asub.add_parser("revoke", help="revoke a user's credentials (applied when the servers reload)")
    _common(rv)
    which = rv.add_mutually_exclusive_group(required=True)
    which.add_argument("--user-key", default=None, help="the user's public key (U..., printed when issued)")
    which.add_argument("--creds-file", default=None, metavar="FILE", help="the .creds file to revoke")
    rv.set_defaults(func=_cmd(_revoke))


class UpAuth:
    """The identities ``timeslice up`` runs with: its auth dir in the data dir (or ``--auth-dir``), the nats-server
    config it loads, fresh orchestrator and agent credentials there, and the ``local`` credentials its URL file's
    readers use (``bus.local_creds_file()``, beside the URL file)."""

    def __init__(self, auth_dir: Path) -> None:
        self.auth, _ = AuthDir.init(auth_dir)
        self.dir = self.auth.path
        self.server_config = self.auth.write_server_config()
        self.orchestrator = self._issue("orchestrator.creds", "orchestrator")

    def _issue(self, name: str, role: str, ident: str | None = None, target: Path | None = None) -> Path:
        path = target or self.dir / name
        write_private(path, self.auth.issue(role, ident).creds())
        return path

    def agent(self, node: str) -> Path:
        return self._issue(f"agent-{node}.creds", "agent", node)

    def local(self, target: Path) -> Path:
        """The machine user's credentials (role ``local``) at ``target``, 0600."""
        return self._issue("", "local", target=target)


def warn_no_auth(url: str) -> None:
    print(
        f"timeslice up: WARNING --no-auth: the NATS server at {url} accepts every connection, and whoever can reach "
        "it can grant, revoke and command the agents (as root, on a GPU node); run without --no-auth for "
        "credentials (docs/security.md)",
        file=sys.stderr,
        flush=True,
    )
