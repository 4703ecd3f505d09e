"""Command line: `python -m varlen demo`.

The parser comes from `varlen._cli`, shared by every entry point.
"""
import sys

from ._cli import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m varlen",
                            description="varlen: packed variable-length attention")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo scenarios on the best backend of this machine",
                   description=("The seeds' cases and a realistic packed batch, forward and "
                                "backward on the default backend of this machine (on a GPU, or "
                                "else the cpu or numpy backend), against the float64 "
                                "reference."))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
