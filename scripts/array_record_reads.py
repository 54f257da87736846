"""How ArrayRecord's reads cost on a prepared corpus's shard (the figures behind data/records.py).

    python scripts/array_record_reads.py --rows 1000000 [--drop_caches]

Prepares `--rows` sentences (the shared english_mix corpus, cycled; MiniLM tokenizer, max_length
32) into one shard in a temporary directory, reads it through once (page cache), and times, as
medians in ms: `read([i])` (one row by list, the same row each time), `read(50 random indices)`,
`read(i, i + 1)` (one row by range), and 50 range reads. `--drop_caches` (root only) then drops
the page cache and times 50 range reads of rows not read before, one after another and split over
8 threads (each its own reader), then the same rows again. Prints the load average before and
after, and one JSON line.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from micse_jax import paths
from micse_jax.bench import host, jax_step
from micse_jax.data.prepared import prepare_corpus
from micse_jax.data.records import RANDOM_ACCESS
from micse_jax.tokenization import Tokenizer

BATCH, THREADS = 50, 8


def _median_ms(fn, arguments) -> float:
  times = []
  for argument in arguments:
    t = time.perf_counter()
    fn(argument)
    times.append(time.perf_counter() - t)
  return round(1e3 * statistics.median(times), 4)


def _range_reads(reader, rows):
  return [reader.read(i, i + 1)[0] for i in rows]


def measure(shard: str, rows: int, drop_caches: bool) -> dict:
  from array_record.python.array_record_module import ArrayRecordReader
  reader = ArrayRecordReader(shard, RANDOM_ACCESS)
  rng = np.random.default_rng(0)
  batches = [np.sort(rng.choice(rows, BATCH, replace=False)).tolist() for _ in range(100)]
  result = {
      "list_read_same_row_ms": _median_ms(reader.read, [[5]] * 50),
      "list_read_50_rows_ms": _median_ms(reader.read, batches),
      "range_read_one_row_ms": _median_ms(lambda i: reader.read(i, i + 1), rng.choice(rows, 1000).tolist()),
      "range_reads_50_rows_ms": _median_ms(lambda b: _range_reads(reader, b), batches)}
  if drop_caches:
    subprocess.run("sync; echo 1 > /proc/sys/vm/drop_caches", shell=True, check=True)
    order = np.random.default_rng(1).permutation(rows)
    fresh = [np.sort(order[i * BATCH:(i + 1) * BATCH]).tolist() for i in range(200)]
    readers = [ArrayRecordReader(shard, RANDOM_ACCESS) for _ in range(THREADS)]
    with ThreadPoolExecutor(THREADS) as pool:
      def threaded(b):
        return list(pool.map(_range_reads, readers, [b[k::THREADS] for k in range(THREADS)]))
      result["cold_range_reads_50_rows_ms"] = _median_ms(lambda b: _range_reads(reader, b), fresh[:100])
      result["cold_range_reads_50_rows_8_threads_ms"] = _median_ms(threaded, fresh[100:])
    result["rewarmed_range_reads_50_rows_ms"] = _median_ms(lambda b: _range_reads(reader, b), fresh[:100])
  return result


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=1_000_000)
  p.add_argument("--drop_caches", action="store_true", help="also time reads after dropping the page cache (root)")
  args = p.parse_args()
  model_dir = jax_step.model_dir_for("minilm")
  directory = tempfile.mkdtemp(prefix="micse_array_record_reads_")
  try:
    text = host._corpus_file(directory, paths.corpus_path("english_mix.txt"), args.rows)
    prepared = os.path.join(directory, "prepared")
    prepare_corpus(text, Tokenizer.from_pretrained(model_dir), model_dir, host.MAX_LENGTH, prepared,
                   rows_per_shard=args.rows)
    host._read_through(prepared)
    (shard,) = glob.glob(os.path.join(prepared, "*.array_record-*"))
    before = os.getloadavg()[0]
    result = measure(shard, args.rows, args.drop_caches)
    print(json.dumps({"rows": args.rows, "load_avg_1m": [round(before, 2), round(os.getloadavg()[0], 2)],
                      **result}))
  finally:
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
  main()
