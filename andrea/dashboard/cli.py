"""`andrea dashboard`: the command; the server is imported inside it so `andrea --help` stays instant."""

from __future__ import annotations

import sys


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "dashboard",
        help="serve a live loss dashboard for the runs in a results folder",
        description="Serve a web page that follows every NAME.loss.json under --results as training "
        "appends to it: loss (raw and smoothed) with validation loss, learning rate, gradient norm and "
        "tokens/s, several runs overlaid. Read-only; binds 127.0.0.1 unless told otherwise. "
        "See docs/DASHBOARD.md.",
    )
    p.add_argument("--results", default="results", help="folder to serve (default: results)")
    p.add_argument("--port", type=int, default=8765, help="port (default: 8765; 0 picks a free one)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --host that is not loopback: anyone who can reach it can read the run files")
    p.set_defaults(func=main)


def main(args) -> int:
    from andrea.dashboard.server import DashboardServer

    server = DashboardServer(args.results, args.host, args.port, args.allow_remote)
    print(f"andrea dashboard: serving {args.results} at {server.url}  (Ctrl-C stops)", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
