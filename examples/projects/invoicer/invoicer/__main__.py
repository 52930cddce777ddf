import sys

from .money import format_cents, split_evenly


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python3 -m invoicer TOTAL_CENTS PARTS", file=sys.stderr)
        return 2
    for share in split_evenly(int(argv[0]), int(argv[1])):
        print(format_cents(share))
    return 0


sys.exit(main(sys.argv[1:]))
