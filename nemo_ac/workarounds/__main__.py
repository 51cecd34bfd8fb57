"""``python -m nemo_ac.workarounds [--markdown]``: the registry as a table (the README's is this output)."""

from __future__ import annotations

import argparse

from nemo_ac.workarounds.registry import WORKAROUNDS, markdown_table


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m nemo_ac.workarounds", description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="the README table")
    args = parser.parse_args()
    if args.markdown:
        print(markdown_table(), end="")
        return
    for w in WORKAROUNDS:
        state = "on" if w.active() else "off"
        print(f"{w.name:32} {state:3} torch {w.torch_versions():28} {w.title}")


if __name__ == "__main__":
    main()
