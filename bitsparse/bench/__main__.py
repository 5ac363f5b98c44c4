"""``python -m bitsparse.bench <suite>``: benchmarks that print a table."""

from __future__ import annotations

import argparse

from bitsparse.bench import codec


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bitsparse.bench", description=__doc__)
    suites = parser.add_subparsers(dest="suite", required=True)
    codec.add_arguments(suites.add_parser("codec", help="encode/decode bandwidth against a copy"))
    args = parser.parse_args(argv)
    if args.suite == "codec" and args.sweep:
        codec.sweep(args)
    elif args.suite == "codec":
        codec.run(args)


if __name__ == "__main__":
    main()
