"""Writes N synthetic sentences (one per line) for start-up and memory measurements at scale.

    python scripts/synthetic_corpus.py --num_sentences 1000000 --output /tmp/synth1m.txt

Each sentence is 6–29 words drawn uniformly (seeded) from a few common English words plus
`word0`…`word2999`, ending in a full stop: about 150 bytes a line. Nothing here is meant to be
learnable; it only has the size and the token-length spread of a real corpus.
"""
import argparse

import numpy as np

COMMON = ("the a of and to in is was for on that with as by he at from his it an were are "
          "which this be or has had first new one their its after two also they been who but not").split()


def sentences(num_sentences: int, seed: int, chunk: int = 100_000):
  """Yields blocks of lines, `chunk` sentences at a time."""
  rng = np.random.default_rng(seed)
  words = np.array(COMMON + [f"word{i}" for i in range(3000)])
  for start in range(0, num_sentences, chunk):
    lengths = rng.integers(6, 30, min(chunk, num_sentences - start))
    drawn = words[rng.integers(0, len(words), lengths.sum())]
    ends = np.cumsum(lengths)
    yield [" ".join(drawn[end - n:end]) + "." for n, end in zip(lengths, ends)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_sentences", type=int, required=True)
  parser.add_argument("--output", required=True)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  with open(args.output, "w", encoding="utf-8") as f:
    for block in sentences(args.num_sentences, args.seed):
      f.write("\n".join(block) + "\n")


if __name__ == "__main__":
  main()
