"""``python -m cgtrees``: the demo; ``python -m cgtrees cache info|clear``: the cache."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cgtrees",
        description="cgtrees: with no argument, runs the demo (compiles a GPT block with backend='cgtrees', "
                    "checks outputs and gradients against eager, prints compile and per-call times); "
                    "'cache info|clear' manages the persistent compile cache.")
    sub = parser.add_subparsers(dest="command")
    cache = sub.add_parser("cache", help="inspect or clear the persistent compile cache")
    cache.add_argument("action", choices=["info", "clear"])
    args = parser.parse_args(argv)
    if args.command == "cache":
        from cgtrees.cache import cli

        return cli.main(args.action)
    from cgtrees.demo import main as demo

    return demo()


if __name__ == "__main__":
    sys.exit(main())
