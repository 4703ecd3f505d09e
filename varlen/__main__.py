"""Command line: `python -m varlen demo`."""
import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m varlen",
                                     description="varlen: packed variable-length attention")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo scenarios on the best backend of this machine")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
