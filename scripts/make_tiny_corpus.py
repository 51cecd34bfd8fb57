"""Writes data/tiny_corpus.jsonl: a small generated English corpus (public domain by construction) for the tiny
text recipes, so CI trains on real text and the loss falls.

    python scripts/make_tiny_corpus.py            # rewrites data/tiny_corpus.jsonl (deterministic, ~300 KB)

Each line is ``{"text": ...}``: a short story whose sentences follow from each other (counting, colours, places),
so a tiny model can learn more than byte frequencies: after "Tom had 3 apples. Ann gave him 2 more." the next
number is predictable. Also ``data/tiny_chat.jsonl`` with ``{"messages": [...]}`` rows (user asks, assistant
answers) for the chat path.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Ann", "Ben", "Mia", "Sam", "Lea", "Max", "Ivy", "Leo", "Zoe"]
THINGS = ["apples", "books", "cups", "stones", "shells", "coins", "pens", "hats"]
COLOURS = ["red", "blue", "green", "yellow", "white", "black"]
PLACES = ["the park", "the shop", "the river", "the school", "the garden", "the market"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def story(rng: random.Random) -> str:
    a, b = rng.sample(NAMES, 2)
    thing, colour, place = rng.choice(THINGS), rng.choice(COLOURS), rng.choice(PLACES)
    have, more = rng.randint(1, 6), rng.randint(1, 6)
    lose = rng.randint(0, have + more)
    left = have + more - lose
    return (
        f"{a} went to {place}. {a} had {NUMBERS[have]} {colour} {thing}. {b} gave {a} {NUMBERS[more]} more. "
        f"Now {a} had {NUMBERS[have + more]} {colour} {thing}. On the way home {a} lost {NUMBERS[lose]}. "
        f"At home {a} had {NUMBERS[left]} {colour} {thing} left."
    )


def chat(rng: random.Random) -> dict:
    a = rng.choice(NAMES)
    x, y = rng.randint(0, 6), rng.randint(0, 6)
    thing = rng.choice(THINGS)
    return {
        "messages": [
            {"role": "user", "content": f"{a} has {NUMBERS[x]} {thing} and finds {NUMBERS[y]} more. How many now?"},
            {"role": "assistant", "content": f"{a} has {NUMBERS[x + y]} {thing} now."},
        ]
    }


def main() -> None:
    root = Path(__file__).resolve().parents[1] / "data"
    root.mkdir(exist_ok=True)
    rng = random.Random(0)
    with open(root / "tiny_corpus.jsonl", "w") as f:
        for _ in range(1500):
            f.write(json.dumps({"text": story(rng)}) + "\n")
    with open(root / "tiny_chat.jsonl", "w") as f:
        for _ in range(500):
            f.write(json.dumps(chat(rng)) + "\n")


if __name__ == "__main__":
    main()
