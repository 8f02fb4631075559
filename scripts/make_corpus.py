"""Write the project's own small training corpus: atorch/data/assets/corpus.txt.

The text is generated from a fixed seed by a small grammar written for this project, so
the corpus is ours to ship, needs no download, and has enough structure (repeated
phrases, agreement, numbers) for a tiny model's loss to fall within a few steps.
One document per line.

    python scripts/make_corpus.py            # rewrites the file deterministically
"""

import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "atorch" / "data" / "assets" / "corpus.txt"

SUBJECTS = ["the river", "a lighthouse keeper", "the old mill", "a young engineer", "the harbor town",
            "a fleet of barges", "the north wind", "a quiet library", "the night train", "a traveling baker",
            "the glass factory", "a flock of geese", "the orchard", "a mountain village", "the weather station",
            "a pair of clockmakers", "the canal lock", "a school of herring", "the tram line", "a small observatory"]
VERBS = ["watches", "carries", "repairs", "remembers", "measures", "follows", "crosses", "lights", "counts",
         "paints", "shelters", "feeds", "guards", "records", "waits for", "builds", "listens to", "opens"]
OBJECTS = ["the morning tide", "every passing ship", "a wooden bridge", "the first snow", "the harvest moon",
           "a copper kettle", "the long road north", "seven lanterns", "the market square", "a map of the coast",
           "the last ferry", "a basket of apples", "the stone stairs", "a row of poplars", "the evening bells",
           "a letter from the south", "the frozen pond", "a garden of herbs", "the signal tower", "a box of gears"]
PLACES = ["near the bay", "beyond the hills", "under the old bridge", "at the edge of the forest",
          "in the valley", "along the canal", "by the station", "on the island", "past the quarry",
          "behind the cathedral"]
TIMES = ["at dawn", "before the storm", "every winter", "after the festival", "on market days", "at midnight",
         "in early spring", "when the fog lifts", "during the harvest", "once a year"]
CONNECT = ["and then", "while", "because", "although", "so", "until", "after"]
ADJ = ["patient", "careful", "restless", "cheerful", "silent", "steady", "curious", "tired", "bright", "humble"]


def sentence(rng: random.Random) -> str:
    kind = rng.random()
    s, v, o = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(OBJECTS)
    if kind < 0.35:
        text = f"{s} {v} {o} {rng.choice(PLACES)}"
    elif kind < 0.6:
        text = f"{rng.choice(TIMES)}, {s} {v} {o}"
    elif kind < 0.8:
        text = f"{s} {v} {o} {rng.choice(CONNECT)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    elif kind < 0.9:
        n = rng.randint(2, 99)
        text = f"{s} {v} {n} times {rng.choice(TIMES)}, and the count stays at {n}"
    else:
        text = f"the {rng.choice(ADJ)} keeper says that {s} {v} {o}"
    return text[0].upper() + text[1:] + "."


def document(rng: random.Random) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(3, 12)))


def main(n_docs: int = 1000, seed: int = 20261122) -> None:
    rng = random.Random(seed)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(document(rng) for _ in range(n_docs)) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes, {n_docs} documents)")


if __name__ == "__main__":
    main()
