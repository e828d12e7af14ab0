#!/usr/bin/env python
"""Write a small synthetic data set in GLUE's column layout, for offline runs and tests.

The texts come from a tiny template grammar written here; labels follow simple rules (sentiment
words, word overlap, a number in the sentence...), so a model can learn them. It is *not* GLUE:
use it to check that the pipeline runs end to end, not to report GLUE scores.

    python recipes/make_glue_fixture.py --task mnli --out data/mnli --train 512 --validation 128
"""

from __future__ import annotations

import argparse
import csv
import os
import random

from run_glue import TASKS

NOUNS = ["film", "story", "actor", "plot", "song", "city", "garden", "teacher", "river", "machine"]
GOOD = ["wonderful", "brilliant", "charming", "moving", "delightful", "superb"]
BAD = ["dull", "clumsy", "tedious", "awful", "boring", "weak"]
VERBS = ["describes", "shows", "remembers", "visits", "builds", "follows"]


def _sentence(rng: random.Random, positive: bool) -> str:
    adj = rng.choice(GOOD if positive else BAD)
    return f"the {rng.choice(NOUNS)} {rng.choice(VERBS)} a {adj} {rng.choice(NOUNS)}"


def make_row(task: str, rng: random.Random) -> list:
    label = rng.randint(0, 1)
    a = _sentence(rng, rng.random() < 0.5)
    if task == "sst2":
        return [_sentence(rng, bool(label)), label]
    if task == "cola":  # "acceptable" when the words are in order
        words = _sentence(rng, True).split()
        if not label:
            rng.shuffle(words)
        return [" ".join(words), label]
    if task == "stsb":
        b = a if rng.random() < 0.5 else _sentence(rng, True)
        overlap = len(set(a.split()) & set(b.split())) / len(set(a.split()) | set(b.split()))
        return [a, b, round(5.0 * overlap, 2)]
    if task == "mnli":
        label = rng.randint(0, 2)  # 0 entailment, 1 neutral, 2 contradiction
        noun = a.split()[1]
        hyp = {0: f"there is a {noun}", 1: f"the {rng.choice(NOUNS)} is old", 2: f"there is no {noun}"}[label]
        return [a, hyp, label]
    if task in ("qnli", "qqp"):
        q = f"what does the {a.split()[1]} do ?" if label == 0 else f"what does the {rng.choice(NOUNS)} mean ?"
        return [q, a, label] if task == "qnli" else [q, q if label else f"who is the {rng.choice(NOUNS)} ?", label]
    b = a if label else _sentence(rng, rng.random() < 0.5)  # mrpc, rte, wnli: paraphrase / entailment
    return [a, b, label]


def write(task: str, path: str, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t")
        writer.writerow([*(c for c in TASKS[task][:2] if c), "label"])
        for _ in range(n):
            writer.writerow(make_row(task, rng))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", required=True, choices=sorted(TASKS))
    parser.add_argument("--out", required=True, help="folder for train.tsv and dev.tsv (and dev_mismatched.tsv)")
    parser.add_argument("--train", type=int, default=512)
    parser.add_argument("--validation", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write(args.task, os.path.join(args.out, "train.tsv"), args.train, args.seed)
    write(args.task, os.path.join(args.out, "dev.tsv"), args.validation, args.seed + 1)
    if args.task == "mnli":
        write(args.task, os.path.join(args.out, "dev_mismatched.tsv"), args.validation, args.seed + 2)
    print(f"wrote {args.task} fixture to {args.out}")


if __name__ == "__main__":
    main()
