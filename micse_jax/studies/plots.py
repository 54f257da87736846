"""Study figures (matplotlib, Agg): the few-shot curve (miCSE Fig. 3/4a), ablation deltas (Fig. 4b) and,
for a sweep over the batch size, the scores against the batch (SimCSE App. D's batch-size ablation)."""
from __future__ import annotations

import os

import numpy as np

from micse_jax.optional import require

BASELINE = "simcse"
BATCH_AXIS = "batch_size"
BATCH_METRICS = (("sts_avg", "STS avg."), ("STSBenchmark", "STS-B test"))


def pyplot():
  """`matplotlib.pyplot` on the file-only Agg backend (matplotlib is optional: figures only)."""
  require("matplotlib", "drawing figures (sweep --report, analyze)").use("Agg")
  return require("matplotlib.pyplot", "drawing figures (sweep --report, analyze)")


def _series(rows: list[dict], metric: str) -> dict[str, list[tuple[int, float, float]]]:
  """method → [(training-set size, mean, std or 0)] sorted by size, rows with a score only."""
  out: dict[str, list] = {}
  for row in rows:
    score = row["scores"].get(metric)
    if not score or score["mean"] is None or not row["num_sentences"]:
      continue
    out.setdefault(row["method"], []).append((row["num_sentences"], score["mean"], score["std"] or 0.0))
  return {m: sorted(v) for m, v in out.items()}


def _colors(methods) -> dict[str, str]:
  """One colour per method, the same in every figure (matplotlib's default cycle, table order)."""
  cycle = pyplot().rcParams["axes.prop_cycle"].by_key()["color"]
  return {m: cycle[i % len(cycle)] for i, m in enumerate(methods)}


def save_figure(fig, path: str, dpi: int = 120) -> str:
  """Writes `fig` as PNG (creating the folder) and closes it; returns the path."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=dpi)
  pyplot().close(fig)
  return path


def fewshot_curve(rows: list[dict], path: str, metric: str = "sts_avg") -> str | None:
  """STS average against training-set size (log x), one line and mean ± std band per method."""
  series = _series(rows, metric)
  if not series:
    return None
  fig, ax = pyplot().subplots(figsize=(6, 4))
  colors = _colors(series)
  for method, points in series.items():
    x, mean, std = (np.array(v, dtype=float) for v in zip(*points))
    ax.plot(x, mean, marker="o", label=method, color=colors[method])
    ax.fill_between(x, mean - std, mean + std, color=colors[method], alpha=0.2)
  ax.set_xscale("log")
  ax.set_xlabel("training sentences")
  ax.set_ylabel("STS avg. Spearman x100" if metric == "sts_avg" else metric)
  ax.set_title("Few-shot curve (mean ± std over seeds)")
  ax.grid(alpha=0.3)
  ax.legend()
  return save_figure(fig, path)


def ablation_deltas(rows: list[dict], path: str, metric: str = "sts_avg", baseline: str = BASELINE) -> str | None:
  """Per size, each method's mean score minus SimCSE's (bars), with the method's seed std as error bar."""
  series = _series(rows, metric)
  if baseline not in series or len(series) < 2:
    return None
  base = {size: mean for size, mean, _ in series[baseline]}
  others = [m for m in series if m != baseline]
  sizes = sorted(base)
  width = 0.8 / len(others)
  colors = _colors(series)
  fig, ax = pyplot().subplots(figsize=(6, 4))
  for i, method in enumerate(others):
    points = {size: (mean, std) for size, mean, std in series[method]}
    xs = [j for j, s in enumerate(sizes) if s in points]
    deltas = [points[sizes[j]][0] - base[sizes[j]] for j in xs]
    errors = [points[sizes[j]][1] for j in xs]
    ax.bar(np.array(xs) + (i - (len(others) - 1) / 2) * width, deltas, width, yerr=errors, capsize=3, label=method,
           color=colors[method])
  ax.axhline(0, color="black", linewidth=0.8)
  ax.set_xticks(range(len(sizes)), [str(s) for s in sizes])
  ax.set_xlabel("training sentences")
  ax.set_ylabel(f"Δ {metric} vs {baseline}")
  ax.set_title(f"Ablation: difference to {baseline}")
  ax.grid(axis="y", alpha=0.3)
  ax.legend(fontsize="small", loc="best")
  return save_figure(fig, path)


def _batch_series(rows: list[dict], metric: str) -> dict[str, list[tuple[int, float, float]]]:
  """method → [(batch size, mean, std or 0)] sorted by batch, rows with a score only."""
  out: dict[str, list] = {}
  for row in rows:
    score = row["scores"].get(metric)
    if not score or score["mean"] is None or row.get(BATCH_AXIS) is None:
      continue
    out.setdefault(row["method"], []).append((int(row[BATCH_AXIS]), score["mean"], score["std"] or 0.0))
  return {m: sorted(v) for m, v in out.items()}


def batch_size_curve(rows: list[dict], path: str, metrics=BATCH_METRICS) -> str | None:
  """Each of `metrics` against the batch size (log₂ x), one panel per metric, one line and mean ± std
  band per method."""
  panels = [(metric, label, _batch_series(rows, metric)) for metric, label in metrics]
  panels = [p for p in panels if p[2]]
  if not panels:
    return None
  colors = _colors(dict.fromkeys(m for _, _, series in panels for m in series))
  fig, axes = pyplot().subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
  for ax, (metric, label, series) in zip(axes[0], panels):
    for method, points in series.items():
      x, mean, std = (np.array(v, dtype=float) for v in zip(*points))
      ax.plot(x, mean, marker="o", label=method, color=colors[method])
      ax.fill_between(x, mean - std, mean + std, color=colors[method], alpha=0.2)
    batches = sorted({b for points in series.values() for b, _, _ in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (same sentences seen)")
    ax.set_ylabel(f"{label} Spearman x100")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.suptitle("Batch size (mean ± std over seeds)")
  return save_figure(fig, path)


def _one_row_per_size(rows: list[dict]) -> bool:
  """Whether each method has at most one row per training-set size: the few-shot figures' x is the
  size, so a sweep over another axis too (a batch, a weight) has no one curve per method."""
  seen = [(row["method"], row["num_sentences"], row["all_sentences"]) for row in rows]
  return len(seen) == len(set(seen))


def write_plots(rows: list[dict], sweep_dir: str) -> list[str]:
  """Next to the tables, those that have data: fewshot_curve.png and ablation_deltas.png (when the
  size is the only axis besides the method and the seed) and, for a sweep over `batch_size`,
  batch_size_curve.png."""
  made = []
  if _one_row_per_size(rows):
    made += [fewshot_curve(rows, os.path.join(sweep_dir, "fewshot_curve.png")),
             ablation_deltas(rows, os.path.join(sweep_dir, "ablation_deltas.png"))]
  if len({row.get(BATCH_AXIS) for row in rows} - {None}) > 1:
    made.append(batch_size_curve(rows, os.path.join(sweep_dir, "batch_size_curve.png")))
  return [p for p in made if p]
