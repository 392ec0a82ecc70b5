"""`rtxserve keys create|list|revoke`: manage the gateway's API keys file (hashes only; a key is shown once)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .keys import ApiKey, KeysFileError, hash_key, new_secret, read_keys, write_keys


def _create(args, keys: dict[str, ApiKey]) -> int:
    if args.name in keys:
        print(f"rtxserve keys: error: a key named {args.name!r} exists; revoke it first", file=sys.stderr)
        return 2
    models = tuple(m.strip() for m in args.models.split(",") if m.strip()) or ("*",)
    secret = new_secret()
    try:
        priority = int(args.priority) if args.priority.lstrip("-").isdigit() else args.priority
        keys[args.name] = ApiKey(args.name, hash_key(secret), models, args.admin, args.rpm, args.tpm, priority=priority)
    except ValueError as exc:
        print(f"rtxserve keys: error: {exc}", file=sys.stderr)
        return 2
    write_keys(args.keys, keys)
    print(secret)
    print(f"key {args.name!r} created in {args.keys}; it is shown only now, store it safely", file=sys.stderr)
    return 0


def _list(args, keys: dict[str, ApiKey]) -> int:
    print(f"{'name':<20} {'models':<30} {'admin':<6} {'rpm':>8} {'tpm':>10}  created")
    for k in keys.values():
        print(f"{k.name:<20} {','.join(k.models):<30} {'yes' if k.admin else 'no':<6} {k.rpm or '-':>8} "
              f"{k.tpm or '-':>10}  {k.created}")
    return 0


def _revoke(args, keys: dict[str, ApiKey]) -> int:
    if keys.pop(args.name, None) is None:
        print(f"rtxserve keys: error: no key named {args.name!r} in {args.keys}", file=sys.stderr)
        return 2
    write_keys(args.keys, keys)
    print(f"key {args.name!r} revoked; a running gateway refuses it from its next request", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    # --keys is taken before the subcommand or after it (`keys create --keys F`): the subcommands share it as a
    # parent whose default is suppressed, so that a value given after the subcommand is not reset to the default.
    keys_help = "keys file (default RTXSERVE_KEYS_FILE, else ./keys.json)"
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keys", type=Path, default=argparse.SUPPRESS, help=keys_help)
    parser = argparse.ArgumentParser(prog="rtxserve keys", description="Manage the gateway's API keys.")
    parser.add_argument("--keys", type=Path, default=Path(os.environ.get("RTXSERVE_KEYS_FILE", "keys.json")), help=keys_help)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="make a key and print it once", parents=[common])
    c.add_argument("--name", required=True)
    c.add_argument("--models", default="*", help="comma-separated models the key may use, by name or shell-style pattern "
                   "(support-*: every model whose name starts support-; default: all)")
    c.add_argument("--admin", action="store_true", help="may use every model")
    c.add_argument("--rpm", type=int, help="requests per minute")
    c.add_argument("--tpm", type=int, help="tokens per minute (generation: prompt + completion)")
    c.add_argument("--priority", default="interactive", help="when requests wait: interactive (0, first), batch (10), "
                   "or a whole number, lower first")
    c.set_defaults(run=_create)
    sub.add_parser("list", help="the keys (names, models, quotas; never the keys themselves)",
                   parents=[common]).set_defaults(run=_list)
    r = sub.add_parser("revoke", help="remove a key", parents=[common])
    r.add_argument("name")
    r.set_defaults(run=_revoke)
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        keys = read_keys(args.keys)
    except KeysFileError as exc:
        print(f"rtxserve keys: error: {exc}", file=sys.stderr)
        return 2
    return args.run(args, keys)
