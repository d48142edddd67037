"""`python -m kiln.cli ARGS` as the docs test gives it to scripts: checks the command line and the
config without running them (a multi-process launch or a script's two trainings are beyond the
test's time); `kiln config` runs for real, since scripts read its output."""

import sys

from kiln.cli import main, parse_args
from kiln.config import load_config
from kiln.errors import KilnError


def dry(argv: list[str]) -> int:
    args = parse_args(argv)  # a usage mistake exits 2 here, as it would for real
    if args.command == "config":
        return main(argv)
    try:
        if getattr(args, "config", None):
            load_config(args.config, args.overrides)
    except KilnError as e:
        print(f"kiln: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(dry(sys.argv[1:]))
