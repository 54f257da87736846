"""configs/sweeps/micse_paper.py against the numbers of the miCSE paper (Tab. 3 / 4 protocol) and of
the authors' public README (SAP-samples/acl2023-micse), and its `--dry_run` output."""
import itertools
import os
import subprocess
import sys

import pytest

from micse_jax.studies import spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_FILE = "configs/sweeps/micse_paper.py"
# The paper: sizes 10^3, 5·10^3, 10^4, 10^5 and 10^6 = all of wiki1m (0 = the whole corpus).
PAPER_SIZES = {1_000, 5_000, 10_000, 100_000, 0}
PAPER_SEEDS = {48, 49, 50, 51, 52}  # 5 random subsets per size
PAPER_FIELDS = {  # miCSE §4 / App.: BERT-base, batch 50, lr 3e-5, 250 warm-up steps, λ 2.5e-3, ...
    "model.name_or_path": "bert-base-uncased", "batch_size": 50, "optim.learning_rate": 3e-5,
    "optim.warmup_steps": 250, "ami.weight": 2.5e-3, "momentum.queue_size": 384, "momentum.decay": 0.995,
    "momentum.dropout": 0.3, "model.max_length": 32, "loss.temperature": 0.05,
    "num_train_steps": 20_000,  # one epoch of 10^6 sentences at batch 50, at every size
}
# README commands: split -> (sentences, λ, epochs, eval_steps); steps = epochs * ceil(n / 64).
README_SPLITS = {100: (1e-3, 2500, 250, 2500 * 2), 1_000: (1e-3, 500, 500, 500 * 16),
                 10_000: (1e-4, 50, 500, 50 * 157), 100_000: (5e-4, 10, 500, 10 * 1563)}


def _runs(variant, tmp_path):
  return spec.expand(spec.load_config_file(f"{SWEEP_FILE}:{variant}"), str(tmp_path / variant))


def _resolved(run):
  """The training config a run gets: its method config with the run's overrides applied."""
  config = spec.load_config_file(run.config_file)
  for key, value in run.overrides:
    spec.set_field(config, key, value, run.config_file)
  return config


def _field(config, dotted):
  for part in dotted.split("."):
    config = config[part]
  return config


def _grid(runs):
  return {(r.label("method"), r.label("data.num_sentences"), r.label("seed")) for r in runs}


def test_fewshot_is_tab3_protocol(tmp_path):
  runs = _runs("fewshot", tmp_path)
  methods = {"simcse": (False, False), "micse": (True, True), "ami_simcse": (True, False),
             "moco_simcse": (False, True)}  # (AMI, momentum encoder + queue)
  assert len(runs) == 4 * 5 * 5 == 100
  assert _grid(runs) == set(itertools.product(methods, PAPER_SIZES, PAPER_SEEDS))
  for run in runs:
    config = _resolved(run)
    for key, want in PAPER_FIELDS.items():
      assert _field(config, key) == pytest.approx(want), (run.name, key)
    assert (config.ami.enabled, config.momentum.enabled) == methods[run.label("method")], run.name
    assert config.ami.variant == "paper" and config.loss.objective == "infonce"
    assert config.data.subset_seed == config.seed == run.label("seed")
    assert config.data.num_sentences == run.label("data.num_sentences")
    assert config.eval.final_tasks == "sts"
    assert config.momentum.mask_same_sentence is False  # the paper's loss


def test_positive_only_is_tab4_protocol(tmp_path):
  runs = _runs("positive_only", tmp_path)
  assert len(runs) == 2 * 5 * 5
  assert _grid(runs) == set(itertools.product(("positive_only", "ami_positive_only"), PAPER_SIZES, PAPER_SEEDS))
  for run in runs:
    config = _resolved(run)
    for key, want in PAPER_FIELDS.items():
      assert _field(config, key) == pytest.approx(want), (run.name, key)
    assert config.loss.objective == "positive_only" and not config.momentum.enabled
    assert config.ami.enabled == (run.label("method") == "ami_positive_only")


def test_official_is_the_readme_recipe(tmp_path):
  runs = _runs("official", tmp_path)
  assert len(runs) == 2 * 4 * 5
  assert _grid(runs) == set(itertools.product(("ami_simcse", "simcse"), README_SPLITS, PAPER_SEEDS))
  for run in runs:
    config = _resolved(run)
    weight, _, eval_steps, steps = README_SPLITS[run.label("data.num_sentences")]
    assert (config.batch_size, config.optim.learning_rate, config.optim.warmup_steps) == (64, 1e-5, 0)
    assert config.model.name_or_path == "bert-base-uncased" and config.model.max_length == 32
    assert config.ami.variant == "official" and tuple(config.ami.layers) == (7, 8, 9, 10)
    assert config.ami.weight == pytest.approx(weight)
    assert (config.num_train_steps, config.eval_every) == (steps, eval_steps)
    assert config.ami.enabled == (run.label("method") == "ami_simcse") and not config.momentum.enabled
    # Only the split names a run; λ, steps and eval interval follow it.
    assert [k for k, _ in run.labels] == ["method", "data.num_sentences", "seed"]


def test_unknown_variant_is_an_error():
  with pytest.raises(ValueError, match="unknown variant"):
    spec.load_config_file(f"{SWEEP_FILE}:tab5")


def _dry_run(tmp_path, *extra):
  done = subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={SWEEP_FILE}:fewshot",
                         "--executor=slurm", "--dry_run", f"--sweep_dir={tmp_path / 'sw'}", *extra],
                        cwd=REPO, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_dry_run_prints_run_count_gpu_hours_and_sbatch(tmp_path):
  out = _dry_run(tmp_path, "--step_ms=72")
  assert "[sweep] micse_paper_fewshot: 100 runs, 0 finished, 100 to run" in out
  # 100 runs × 20,000 steps × 72 ms = 144,000,000 ms = 40.0 GPU-hours at one GPU per run.
  assert ("expected cost: 100 runs, 2,000,000 training steps × 72 ms/step × 1 GPU/run = 40.0 GPU-hours"
          in out)
  assert "Step time: --step_ms" in out
  assert sum(line.startswith(f"{sys.executable} -m micse_jax.main") for line in out.splitlines()) == 100
  lines = [line.strip() for line in out.splitlines()]
  for expected in ("#SBATCH --array=0-99%64", "#SBATCH --gpus-per-node=1", "#SBATCH --nodes=1"):
    assert expected in lines, expected
  with open(tmp_path / "sw" / "sweep.sbatch", encoding="utf-8") as f:
    assert f.read().strip() in out  # the script printed is the script written


def test_dry_run_counts_only_the_steps_left_of_a_resumed_run(tmp_path):
  os.makedirs(tmp_path / "sw" / "method=micse__data.num_sentences=1000__seed=48" / "checkpoints" / "5000")
  out = _dry_run(tmp_path, "--step_ms=72")
  assert "resume from step 5000" in out
  # (100 × 20,000 - 5,000) steps × 72 ms = 39.9 GPU-hours.
  assert "100 runs, 1,995,000 training steps × 72 ms/step × 1 GPU/run = 39.9 GPU-hours" in out


def test_dry_run_default_step_time_is_the_stated_estimate(tmp_path):
  from micse_jax.configs.sweeps import micse_paper
  out = _dry_run(tmp_path)
  hours = 100 * 20_000 * micse_paper.STEP_MS_ESTIMATE / 3.6e6
  assert f"× {micse_paper.STEP_MS_ESTIMATE:g} ms/step × 1 GPU/run = {hours:,.1f} GPU-hours" in out
  assert "Step time: ESTIMATE (no GPU measurement yet)" in out
