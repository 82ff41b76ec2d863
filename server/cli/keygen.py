"""``fuelline keygen DIR [--name NAME]``: write a CURVE key pair for a server or a client."""

from __future__ import annotations

import argparse
import os

from fuelline.server.serving.keys import keygen

__all__ = ["register", "run"]


def _key_name(text: str) -> str:
    if not text or text.startswith(".") or os.sep in text or (os.altsep and os.altsep in text):
        raise argparse.ArgumentTypeError(f"must be a plain file name, got {text!r}")
    return text


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("keygen", help="write a CURVE key pair for a server or a client")
    p.add_argument("dir", help="directory to write NAME.key (public) and NAME.key_secret (secret) in")
    p.add_argument("--name", type=_key_name, default="server",
                   help="server (default) for `serve --curve-keys DIR`; client for a client's DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    public, secret = keygen(args.dir, args.name)
    print(f"wrote {public} (public: share it) and {secret} (secret, mode 600: keep it here)")
    if args.name == "server":
        print(f"clients to accept: put their public .key files in {os.path.join(args.dir, 'authorized')}/")
    return 0
