"""configs/sweeps/batch_size.py: the batch-size study's cells (methods × batches × seeds, the same sentences
seen, the square-root learning rate, blocks that divide the batch), its SLURM dry run and its report."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from micse_jax.studies import plots, runner, spec
from micse_jax.training import grad_cache
from tests.micse_paper_sweep_test import _resolved  # a run's training config with its overrides
from tests.sweep_test import _assert_png

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_FILE = "configs/sweeps/batch_size.py"
PAPER_BATCHES = (64, 128, 256, 512, 1024, 2048, 4096)
TINY_BATCHES = (8, 16, 32, 64, 128)
# (variant, batches, seeds, sentences per cell, rows per block, (lr₀, B₀) of lr = lr₀ √(B / B₀))
VARIANTS = {"": (PAPER_BATCHES, (0, 1, 2), 1_024_000, 128, (3e-5, 64)),
            ":tiny": (TINY_BATCHES, (0, 1), 8_192, 32, (1e-4, 32))}


def _cells(variant, tmp_path):
  runs = spec.expand(spec.load_config_file(f"{SWEEP_FILE}{variant}"), str(tmp_path / "sw"))
  return runs, [_resolved(run) for run in runs]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cells_are_methods_by_batches_by_seeds(tmp_path, variant):
  batches, seeds, _, _, _ = VARIANTS[variant]
  runs, cells = _cells(variant, tmp_path)
  assert len(runs) == 2 * len(batches) * len(seeds)
  got = {(r.label("method"), r.label("batch_size"), r.label("seed")) for r in runs}
  assert got == {(m, b, s) for m in ("simcse", "micse") for b in batches for s in seeds}
  for run, c in zip(runs, cells):
    micse = run.label("method") == "micse"
    assert (c.ami.enabled, c.momentum.enabled) == (micse, micse) and c.loss.objective == "infonce"
    assert c.batch_size == run.label("batch_size") and c.seed == c.data.subset_seed == run.label("seed")
    assert c.eval.final_tasks == "sts"
    assert [k for k, _ in run.labels] == ["seed", "batch_size", "method"]  # the batch names the run
  # seeds outermost: with one run at a time (--population_size 1), every cell of seed 0 comes first
  assert [r.label("seed") for r in runs] == sorted(r.label("seed") for r in runs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_cell_sees_the_same_sentences(tmp_path, variant):
  _, _, sentences, _, _ = VARIANTS[variant]
  _, cells = _cells(variant, tmp_path)
  for c in cells:
    assert c.num_train_steps * c.batch_size == sentences
  steps = {c.batch_size: c.num_train_steps for c in cells}
  if variant == "":  # 1,024,000 / 64 and / 4,096
    assert (steps[64], steps[4096]) == (16_000, 250)
  else:  # 8,192 / 8 and / 128
    assert (steps[8], steps[128]) == (1_024, 64)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_chunk_size_divides_every_batch_and_caps_the_block(tmp_path, variant):
  _, _, _, cap, _ = VARIANTS[variant]
  _, cells = _cells(variant, tmp_path)
  blocked = set()
  for c in cells:
    rows = int(c.chunk_size)
    assert rows == min(c.batch_size, cap) and c.batch_size % rows == 0
    for devices in (1, 2, 4, 8):  # what the step checks on a mesh of that many devices (rows % devices == 0)
      if rows % devices == 0:
        assert grad_cache.blocks_per_device(c, c.batch_size, devices) == c.batch_size // rows
    if rows < c.batch_size:
      blocked.add(c.batch_size)
  assert blocked == {b for b in VARIANTS[variant][0] if b > cap}  # the large batches run the GradCache step


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_square_root_learning_rate_queue_warmup_and_evaluations_follow_the_batch(tmp_path, variant):
  _, _, _, _, (lr0, batch0) = VARIANTS[variant]
  _, cells = _cells(variant, tmp_path)
  hand = {(64, 3e-5), (256, 6e-5), (1024, 1.2e-4), (4096, 2.4e-4)} if variant == "" else \
      {(8, 5e-5), (32, 1e-4), (128, 2e-4)}
  for c in cells:
    assert c.optim.learning_rate == pytest.approx(lr0 * math.sqrt(c.batch_size / batch0))
    assert c.momentum.queue_size == 6 * c.batch_size >= c.batch_size
  lrs = {(c.batch_size, c.optim.learning_rate) for c in cells}
  for batch, lr in hand:
    assert any(b == batch and r == pytest.approx(lr) for b, r in lrs)
  warmup, every = (12_800, 40_960) if variant == "" else (512, 2_048)
  for c in cells:  # counted in sentences: the same share of training at every batch
    assert c.optim.warmup_steps == math.ceil(warmup / c.batch_size)
    assert c.eval_every * c.batch_size == every and c.checkpoint_every == c.eval_every


def test_paper_variant_is_bert_base_with_the_papers_settings(tmp_path):
  _, cells = _cells("", tmp_path)
  for c in cells:
    assert c.model.name_or_path == "bert-base-uncased" and c.model.max_length == 32
    assert (c.loss.temperature, c.ami.weight, c.momentum.decay, c.momentum.dropout) == (0.05, 2.5e-3, 0.995, 0.3)


def test_smoke_variant_and_unknown_variant(tmp_path):
  runs, cells = _cells(":smoke", tmp_path)
  assert [(r.label("batch_size"), r.label("method")) for r in runs] == [
      (8, "simcse"), (8, "micse"), (64, "simcse"), (64, "micse")]
  assert all(c.num_train_steps == 2 for c in cells) and cells[-1].chunk_size == "32"
  with pytest.raises(ValueError, match="unknown variant"):
    spec.load_config_file(f"{SWEEP_FILE}:huge")


def test_gpu_hours_scale_the_step_time_with_each_runs_batch(tmp_path):
  runs = spec.expand(spec.load_config_file(SWEEP_FILE), str(tmp_path / "sw"))
  steps, hours = spec.estimated_gpu_hours(runs, step_ms=10.0, step_ms_batch=64)
  # per (method, seed): Σ_B 1,024,000 / B steps; each step 10 ms × B / 64, so 1,024,000 × 10 / 64 ms per run
  assert steps == 6 * (16_000 + 8_000 + 4_000 + 2_000 + 1_000 + 500 + 250)
  assert hours == pytest.approx(42 * 1_024_000 * 10 / 64 / 3.6e6)
  with pytest.raises(spec.SweepError, match="step_ms_batch must be > 0"):
    spec.estimated_gpu_hours(runs, step_ms=10.0, step_ms_batch=0)


def test_slurm_dry_run_prints_the_plan_cost_and_sbatch(tmp_path):
  done = subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={SWEEP_FILE}", "--executor=slurm",
                         "--dry_run", "--step_ms=10", f"--sweep_dir={tmp_path / 'sw'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "[sweep] batch_size: 42 runs, 0 finished, 42 to run" in out
  # 190,500 steps; 42 runs × 1,024,000 sentences × 10 ms / 64 rows = 6,720,000 ms = 1.9 GPU-hours
  assert ("expected cost: 42 runs, 190,500 training steps × 10 ms/step at batch 64 (× each run's batch / 64) "
          "× 1 GPU/run = 1.9 GPU-hours") in out
  commands = [line for line in out.splitlines() if line.startswith(f"{sys.executable} -m micse_jax.main")]
  assert len(commands) == 42
  big = [c for c in commands if "--config.batch_size=4096" in c]
  assert len(big) == 6 and all("--config.chunk_size=128" in c and "--config.num_train_steps=250" in c for c in big)
  lines = [line.strip() for line in out.splitlines()]
  assert "#SBATCH --array=0-41%42" in lines  # at most --max_parallel (64) at once: all 42 and "#SBATCH --gpus-per-node=1" in lines
  with open(tmp_path / "sw" / "sweep.sbatch", encoding="utf-8") as f:
    assert f.read().strip() in out


def _finish(run, sts_b, sick):
  """A finished run's folder: status done and results.json with two STS tasks."""
  os.makedirs(run.workdir, exist_ok=True)
  with open(os.path.join(run.workdir, runner.STATUS_FILE), "w", encoding="utf-8") as f:
    json.dump({"status": "done", "error": None}, f)
  with open(os.path.join(run.workdir, "results.json"), "w", encoding="utf-8") as f:
    json.dump({"sts": {"tasks": {"STSBenchmark": {"spearman": sts_b}, "SICKRelatedness": {"spearman": sick}},
                       "avg": (sts_b + sick) / 2}}, f)


def _fake_scores(run):
  """STS-B rises by 1 per doubling of the batch, miCSE 0.5 above SimCSE, seed 1 two above seed 0."""
  sts_b = 50 + math.log2(run.label("batch_size")) + 0.5 * (run.label("method") == "micse") + 2 * run.label("seed")
  return sts_b, sts_b - 10


def test_report_of_finished_runs_draws_the_batch_curve(tmp_path):
  sweep_dir = str(tmp_path / "sw")
  runs = spec.expand(spec.load_config_file(f"{SWEEP_FILE}:tiny"), sweep_dir)
  for run in runs:
    if not (run.label("batch_size") == 128 and run.label("seed") == 1):  # one seed of batch 128 unfinished
      _finish(run, *_fake_scores(run))
  done = subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={SWEEP_FILE}:tiny", "--report",
                         f"--sweep_dir={sweep_dir}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(sweep_dir, "results.csv"), encoding="utf-8") as f:
    rows = {(r["method"], int(r["batch_size"])): r for r in csv.DictReader(f)}
  assert set(rows) == {(m, b) for m in ("simcse", "micse") for b in TINY_BATCHES}
  # batch 8 SimCSE: STS-B 53 and 55 (seeds 0, 1): mean 54, sample std √2; SICK-R 10 lower; avg 49
  assert float(rows[("simcse", 8)]["STSBenchmark_mean"]) == pytest.approx(54.0)
  assert float(rows[("simcse", 8)]["STSBenchmark_std"]) == pytest.approx(math.sqrt(2), rel=1e-5)
  assert float(rows[("simcse", 8)]["sts_avg_mean"]) == pytest.approx(49.0)
  assert rows[("micse", 128)]["n_seeds"] == "1" and float(rows[("micse", 128)]["STSBenchmark_mean"]) == 57.5
  assert rows[("micse", 128)]["STSBenchmark_std"] == ""
  assert "seed=1__batch_size=128__method=micse`: not run" in open(
      os.path.join(sweep_dir, "results.md"), encoding="utf-8").read()
  _assert_png(os.path.join(sweep_dir, "batch_size_curve.png"))
  # one training-set size, several rows per method: no few-shot curve
  assert not os.path.exists(os.path.join(sweep_dir, "fewshot_curve.png"))
  assert "batch_size_curve.png" in done.stdout


def test_batch_curve_plots_each_methods_mean_against_its_batch(tmp_path, monkeypatch):
  from matplotlib.axes import Axes
  rows = [{"method": m, "batch_size": b, "num_sentences": 100, "all_sentences": False,
           "scores": {"sts_avg": {"mean": 60.0 + b / 8 + (m == "micse"), "std": 0.5}}}
          for m in ("simcse", "micse") for b in (32, 8, 16)]
  drawn, original = {}, Axes.plot

  def spy(ax, x, y, *args, **kwargs):
    drawn[kwargs["label"]] = (list(x), list(y))
    return original(ax, x, y, *args, **kwargs)

  monkeypatch.setattr(Axes, "plot", spy)
  path = plots.batch_size_curve(rows, str(tmp_path / "curve.png"))
  _assert_png(path)
  assert drawn == {"simcse": ([8, 16, 32], [61.0, 62.0, 64.0]), "micse": ([8, 16, 32], [62.0, 63.0, 65.0])}
  assert plots.write_plots(rows, str(tmp_path)) == [os.path.join(str(tmp_path), "batch_size_curve.png")]


def test_few_shot_figures_still_drawn_for_a_size_sweep(tmp_path):
  rows = [{"method": m, "num_sentences": n, "all_sentences": False, "n": 1, "seeds": [0],
           "scores": {"sts_avg": {"mean": 60.0 + n / 64, "std": None}}} for m in ("simcse", "micse") for n in (64, 512)]
  assert [os.path.basename(p) for p in plots.write_plots(rows, str(tmp_path))] == [
      "fewshot_curve.png", "ablation_deltas.png"]


def test_report_without_a_population_plan_reports_every_run_alone(tmp_path):
  """A sweep launched with --population_size 1 leaves no chosen sizes: `--report` (auto) gets {} and
  reports each run from its own workdir."""
  runs = spec.expand(spec.load_config_file(f"{SWEEP_FILE}:smoke"), str(tmp_path / "sw"))
  launched, reported = spec.group_populations(runs, {}, str(tmp_path / "sw"))
  assert launched == runs and reported == runs
