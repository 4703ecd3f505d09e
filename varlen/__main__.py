"""Command line: `python -m varlen demo`.

`ArgumentParser` and `positive_int` are shared by every entry point (`python -m varlen`,
`python -m varlen.comm`, `scripts/*.py`) so that a bad argument reads the same everywhere: one
line on stderr, exit status 2, no traceback.
"""
import argparse
import sys


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`prog: error: message (see prog --help)`), exit 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m varlen",
                            description="varlen: packed variable-length attention")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo scenarios on the best backend of this machine",
                   description=("The seeds' cases and a realistic packed batch, forward and "
                                "backward on the best backend of this machine (CuPy on a GPU, "
                                "else NumPy), against the float64 reference."))
    args = parser.parse_args(argv)
    if args.command == "demo":
        from ._demo import main as demo
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
