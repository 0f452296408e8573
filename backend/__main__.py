"""``python -m cgtrees``: the demo; ``python -m cgtrees cache info|clear``: the cache;
``python -m cgtrees tree --out tree.svg``: a picture of the CUDA graph trees of a few training steps."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cgtrees",
        description="cgtrees: with no argument, runs the demo (compiles a GPT block with backend='cgtrees', "
                    "checks outputs and gradients against eager, prints compile and per-call times); "
                    "'cache info|clear' manages the persistent compile cache; 'tree --out tree.svg' draws the "
                    "CUDA graph trees of a few training steps of the demo's block.")
    sub = parser.add_subparsers(dest="command")
    cache = sub.add_parser("cache", help="inspect or clear the persistent compile cache")
    cache.add_argument("action", choices=["info", "clear"])
    tree = sub.add_parser("tree", help="train the demo's block a few steps and draw its CUDA graph trees "
                                       "(in your own program: cgtrees.runtime.picture.write(path))")
    tree.add_argument("--out", default="tree.svg",
                      help="the picture (.svg, .png or .pdf with Graphviz's dot installed; else DOT text, .dot)")
    tree.add_argument("--steps", type=int, default=6, help="training steps before drawing")
    args = parser.parse_args(argv)
    if args.command == "cache":
        from cgtrees.cache import cli

        return cli.main(args.action)
    if args.command == "tree":
        from cgtrees.demo import draw_tree

        return draw_tree(args.out, args.steps)
    from cgtrees.demo import main as demo

    return demo()


if __name__ == "__main__":
    sys.exit(main())
