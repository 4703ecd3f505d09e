"""Command-line pieces shared by every entry point (`python -m varlen`, `python -m varlen.comm`,
`scripts/*.py`), so that a bad argument reads the same everywhere: one line on stderr, exit
status 2, no traceback.
"""
import argparse

__all__ = ["ArgumentParser", "positive_int", "name_list"]


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


def name_list(choices):
    """An argparse type: comma-separated names, each one of `choices`."""
    def parse(text: str) -> list:
        names = [x for x in text.split(",") if x]
        bad = [x for x in names if x not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {','.join(bad) or text!r}; choose from "
                                             f"{','.join(choices)}")
        return names
    return parse
