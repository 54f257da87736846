"""Sweep runner: expansion, bad input, aggregation (hand-computed), figures, SLURM submission, end to end."""
import json
import math
import os
import shutil
import subprocess
import sys

import ml_collections
import pytest

from micse_jax.studies import aggregate, plots, runner, spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _sweep(**fields):
  c = ml_collections.ConfigDict()
  c.name = "t"
  c.base_config = "configs/micse.py"
  c.num_train_steps = 7
  c.eval_tasks = "STSBenchmark"
  c.overrides = (("batch_size", 4),)
  c.axes = (("method", ("simcse", "micse")), ("data.num_sentences", (8, 0.5)), ("seed", (0, 1)))
  for k, v in fields.items():
    c[k] = v
  return c


def _corpus(tmp_path, n=20):
  path = tmp_path / "corpus.txt"
  path.write_text("\n\n".join(f"line {i}" for i in range(n)) + "\n", encoding="utf-8")
  return str(path)


def test_expansion_is_the_hand_listed_grid(tmp_path):
  corpus = _corpus(tmp_path)  # 20 sentences: the fraction 0.5 is 10
  sweep = _sweep(overrides=(("batch_size", 4), ("data.corpus", corpus)))
  runs = spec.expand(sweep, str(tmp_path / "sw"))
  assert [r.name for r in runs] == [
      "method=simcse__data.num_sentences=8__seed=0", "method=simcse__data.num_sentences=8__seed=1",
      "method=simcse__data.num_sentences=0.5__seed=0", "method=simcse__data.num_sentences=0.5__seed=1",
      "method=micse__data.num_sentences=8__seed=0", "method=micse__data.num_sentences=8__seed=1",
      "method=micse__data.num_sentences=0.5__seed=0", "method=micse__data.num_sentences=0.5__seed=1"]
  run = runs[3]
  assert run.config_file == "simcse"  # a packaged config's name: the job's micse_jax resolves it
  assert run.workdir == str(tmp_path / "sw" / run.name)
  assert dict(run.overrides) == {"batch_size": 4, "data.corpus": corpus, "num_train_steps": 7,
                                 "eval.final_tasks": "STSBenchmark", "data.num_sentences": 10,
                                 "seed": 1, "data.subset_seed": 1}
  command = spec.main_command(run, python="py")
  assert command[:5] == ["py", "-m", "micse_jax.main", "--config=simcse", f"--workdir={run.workdir}"]
  assert "--config.data.num_sentences=10" in command and "--config.data.subset_seed=1" in command


@pytest.mark.parametrize("fields,message", [
    ({"axes": (("optim.lr", (1e-4,)),)}, "unknown axis/override key 'optim.lr': optim.lr is not a field"),
    ({"axes": (("method", ()),)}, "axis 'method' is empty"),
    ({"axes": (("method", ("nosuch",)),)}, "'nosuch' is neither a file nor a packaged config"),
    ({"axes": (("batch_size", ("big",)),)}, "bad value 'big' for batch_size"),
    ({"axes": (("optim.learning_rate", (-1.0,)),)}, "optim.learning_rate"),  # config_checks' range
])
def test_bad_sweeps_raise_one_line(tmp_path, fields, message):
  with pytest.raises(spec.SweepError) as e:
    spec.expand(_sweep(**fields), str(tmp_path))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_zipped_axis_moves_fields_together(tmp_path):
  """A zipped axis: one point per tuple (not a product); the first key names the run, the others follow."""
  sweep = _sweep(axes=(("method", ("simcse",)),
                       (("data.num_sentences", "ami.weight", "num_train_steps"), ((8, 1e-3, 30), (16, 5e-4, 60))),
                       ("seed", (0, 1))))
  runs = spec.expand(sweep, str(tmp_path / "sw"))
  assert [r.name for r in runs] == [
      "method=simcse__data.num_sentences=8__seed=0", "method=simcse__data.num_sentences=8__seed=1",
      "method=simcse__data.num_sentences=16__seed=0", "method=simcse__data.num_sentences=16__seed=1"]
  assert [(o["data.num_sentences"], o["ami.weight"], o["num_train_steps"])
          for o in (dict(r.overrides) for r in runs)] == [(8, 1e-3, 30), (8, 1e-3, 30), (16, 5e-4, 60), (16, 5e-4, 60)]
  assert runs[2].labels == (("method", "simcse"), ("data.num_sentences", 16), ("seed", 0))
  # The axis' num_train_steps wins over the sweep-wide one (7).
  assert spec.main_command(runs[3], python="py").count("--config.num_train_steps=60") == 1


@pytest.mark.parametrize("axes,message", [
    (((("ami.weight", "num_train_steps"), ((1e-3, 5), (1e-4,))),), "needs 2 values per point, got (0.0001,)"),
    (((("method", "ami.weight"), (("simcse", 1e-3),)),), "axis 'method' cannot be zipped"),
    (((("seed", "ami.weight"), ((0, 1e-3),)),), "axis 'seed' cannot be zipped"),
    (((("ami.weight",), ((1e-3,),)),), "a zipped axis needs at least two keys"),
    ((("ami.weight", (1e-3,)), (("batch_size", "ami.weight"), ((4, 1e-3),))), "axis 'ami.weight' appears twice"),
    (((("batch_size", "ami.weight"), ((4, 1e-3), (4, 1e-4))),), "axis ('batch_size', 'ami.weight') repeats a value"),
    (((("batch_size", "ami.wieght"), ((4, 1e-3),)),), "unknown axis/override key 'ami.wieght'"),
])
def test_bad_zipped_axes_raise_one_line(tmp_path, axes, message):
  with pytest.raises(spec.SweepError) as e:
    spec.expand(_sweep(axes=axes), str(tmp_path))
  assert message in str(e.value) and "\n" not in str(e.value)


def test_gpu_hours_estimate_is_steps_times_step_time(tmp_path):
  sweep = _sweep(axes=(("method", ("simcse", "micse")),
                       (("data.num_sentences", "num_train_steps"), ((8, 1000), (16, 3000)))))
  runs = spec.expand(sweep, str(tmp_path))
  steps, hours = spec.estimated_gpu_hours(runs, step_ms=90.0, gpus_per_run=2)
  assert steps == 2 * (1000 + 3000)
  assert hours == pytest.approx(8000 * 0.090 / 3600 * 2)  # 0.4 GPU-hours
  # Resumed runs count only the steps after their checkpoint.
  steps, hours = spec.estimated_gpu_hours(runs, 90.0, 1, {runs[1].name: 2500, runs[0].name: 0})
  assert steps == 1000 + 500 + 1000 + 3000 and hours == pytest.approx(5500 * 0.090 / 3600)
  with pytest.raises(spec.SweepError, match="step time must be > 0"):
    spec.estimated_gpu_hours(runs, step_ms=0.0)


def _fake_run(sweep_dir, method, size, seed, sts, status="done"):
  run = spec.RunSpec(name=f"{method}-{size}-{seed}", config_file=f"configs/{method}.py",
                     overrides=(("data.num_sentences", size), ("seed", seed)),
                     labels=(("method", method), ("data.num_sentences", size), ("seed", seed)),
                     workdir=os.path.join(sweep_dir, f"{method}-{size}-{seed}"))
  os.makedirs(run.workdir)
  with open(os.path.join(run.workdir, runner.STATUS_FILE), "w") as f:
    json.dump({"status": status, "error": "error: boom" if status == "failed" else None}, f)
  if status == "done":
    with open(os.path.join(run.workdir, "results.json"), "w") as f:
      json.dump({"sts": {"tasks": {"STSBenchmark": {"spearman": sts[0]}, "SICKRelatedness": {"spearman": sts[1]}},
                         "avg": (sts[0] + sts[1]) / 2}}, f)
  return run


@pytest.fixture
def fake_sweep(tmp_path):
  d = str(tmp_path / "sweep")
  runs = [_fake_run(d, "simcse", 64, 0, (70.0, 60.0)), _fake_run(d, "simcse", 64, 1, (72.0, 61.0)),
          _fake_run(d, "simcse", 64, 2, (77.0, 65.0)),
          _fake_run(d, "micse", 64, 0, (74.0, 62.0)), _fake_run(d, "micse", 64, 1, (75.0, 63.0)),
          _fake_run(d, "micse", 64, 2, (0.0, 0.0), status="failed"),
          _fake_run(d, "simcse", 512, 0, (78.0, 66.0)), _fake_run(d, "micse", 512, 0, (79.0, 69.0))]
  return d, runs


def test_aggregation_matches_hand_computation(fake_sweep):
  sweep_dir, runs = fake_sweep
  document = aggregate.write_reports(runs, sweep_dir, "t")
  rows = {(r["method"], r["num_sentences"]): r for r in document["rows"]}
  simcse = rows[("simcse", 64)]
  # STS-B 70, 72, 77: mean 73, sample variance ((-3)^2 + (-1)^2 + 4^2) / 2 = 13.
  assert simcse["n"] == 3 and simcse["scores"]["STSBenchmark"]["mean"] == pytest.approx(73.0)
  assert simcse["scores"]["STSBenchmark"]["std"] == pytest.approx(math.sqrt(13.0))
  # SICK-R 60, 61, 65: mean 62, variance (4 + 1 + 9) / 2 = 7. Averages 65, 66.5, 71: mean 67.5, deviations -2.5, -1, 3.5 -> variance 19.5 / 2.
  assert simcse["scores"]["sts_avg"]["mean"] == pytest.approx(67.5)
  assert simcse["scores"]["sts_avg"]["std"] == pytest.approx(math.sqrt(9.75))
  micse = rows[("micse", 64)]  # the failed seed is not averaged in
  assert micse["n"] == 2 and micse["scores"]["STSBenchmark"]["mean"] == pytest.approx(74.5)
  assert micse["scores"]["STSBenchmark"]["std"] == pytest.approx(math.sqrt(0.5))
  assert rows[("micse", 512)]["n"] == 1 and rows[("micse", 512)]["scores"]["STSBenchmark"]["std"] is None
  assert document["not_counted"] == [{"run": "micse-64-2", "status": "failed", "error": "error: boom"}]
  md = open(os.path.join(sweep_dir, "results.md"), encoding="utf-8").read()
  assert "| simcse | 64 | 3 | 73.00 ± 3.61 | 62.00 ± 2.65 | 67.50 ± 3.12 |" in md
  assert "| micse | 512 | 1 | 79.00 ± - | 69.00 ± - | 74.00 ± - |" in md
  assert "`micse-64-2`: failed — error: boom" in md
  lines = open(os.path.join(sweep_dir, "results.csv"), encoding="utf-8").read().splitlines()
  assert lines[0] == ("method,data.num_sentences,num_sentences,all_sentences,n_seeds,STSBenchmark_mean,"
                      "STSBenchmark_std,SICKRelatedness_mean,SICKRelatedness_std,sts_avg_mean,sts_avg_std")
  assert lines[1].startswith("simcse,64,64,False,3,73,3.60555,62,2.64575,67.5,3.1225")


def _assert_png(path):
  from PIL import Image
  with open(path, "rb") as f:
    assert f.read(8) == PNG_SIGNATURE
  with Image.open(path) as image:
    image.verify()
  with Image.open(path) as image:
    assert image.format == "PNG" and image.size[0] > 100 and image.size[1] > 100


def test_plots_are_valid_pngs(fake_sweep):
  sweep_dir, runs = fake_sweep
  rows, _ = aggregate.collect(runs)
  paths = plots.write_plots(rows, sweep_dir)
  assert [os.path.basename(p) for p in paths] == ["fewshot_curve.png", "ablation_deltas.png"]
  for p in paths:
    _assert_png(p)


def test_slurm_submission_is_one_array_job(tmp_path):
  from submitit.core import utils as submitit_utils
  from submitit.slurm.test_slurm import mocked_slurm
  runs = spec.expand(_sweep(axes=(("method", ("simcse", "micse", "moco_simcse")),)), str(tmp_path / "sw"))
  params = runner.slurm_parameters(partition="gpu", gpus_per_run=2, cpus_per_run=12, timeout_min=600,
                                   max_parallel=2, account="proj", extra_setup=("module load cuda",))
  folder = str(tmp_path / "sw" / "submitit")
  with mocked_slurm():  # sbatch/srun replaced by submitit's own mock: no cluster
    jobs = runner.submit_slurm(runs, runner.slurm_executor(folder, params))
    script = jobs[0].paths.submission_file.read_text()
    array_id = jobs[0].job_id.split("_")[0]
    assert [j.job_id for j in jobs] == [f"{array_id}_{i}" for i in range(3)]
    pickled = [submitit_utils.DelayedSubmission.load(j.paths.submitted_pickle) for j in jobs]
  lines = [line.strip() for line in script.splitlines()]
  for expected in ("#SBATCH --array=0-2%2", "#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=2",
                   "#SBATCH --cpus-per-task=12", "#SBATCH --time=600", "#SBATCH --account=proj",
                   "#SBATCH --ntasks-per-node=1", "module load cuda"):
    assert expected in lines, (expected, script)
  assert not [line for line in lines if line.startswith("cd ") or "PYTHONPATH" in line], script
  assert sum(line.startswith("srun ") for line in lines) == 1
  assert [p.function for p in pickled] == [runner.run_training] * 3
  assert [p.args[0] for p in pickled] == runs
  assert runner.slurm_script(folder, params, 3).count("#SBATCH --array=0-2%2") == 1


def _write_sweep_file(tmp_path, model_dir, corpus, senteval_dir, axes, steps=4, extra=()):
  path = tmp_path / "sweep_cfg.py"
  path.write_text(f'''import ml_collections
def get_config(arg=None):
  c = ml_collections.ConfigDict()
  c.name = "e2e"
  c.base_config = "configs/micse.py"
  c.num_train_steps = {steps}
  c.eval_tasks = "STSBenchmark"
  c.overrides = (("model.name_or_path", {model_dir!r}), ("data.corpus", {corpus!r}),
                 ("eval.senteval_dir", {senteval_dir!r}), ("batch_size", 8), ("momentum.queue_size", 16),
                 ("model.max_length", 16), ("ami.layers", (0, 1)), ("ami.heads_per_slice", 1),
                 ("ami.num_samples", 20), ("eval_every", 0), ("checkpoint_every", 2), ("log_every", 1),
                 ("optim.warmup_steps", 1)) + {tuple(extra)!r}
  c.axes = {axes!r}
  return c
''', encoding="utf-8")
  return str(path)


def _sweep_cli(*args):
  return subprocess.run([sys.executable, "-m", "micse_jax.sweep", *args], cwd=REPO, capture_output=True,
                        text=True, timeout=900)


def test_cli_bad_input_is_one_line_before_any_run(tmp_path, tiny_real_dir):
  from micse_jax.data.prepared import prepare_corpus
  corpus = _corpus(tmp_path)
  sweep_dir = tmp_path / "sw"
  cases = [((("method", ("simcse",)), ("ami.wieght", (1e-3,))), "unknown axis/override key 'ami.wieght'"),
           ((("method", ("simcse",)), ("seed", ())), "axis 'seed' is empty")]
  # A prepared corpus tokenized with another (small-vocabulary) tokenizer than the model's.
  from tests.prepared_test import _small_vocab_tokenizer
  other = _small_vocab_tokenizer(str(tmp_path / "tok"))
  prepared_dir = str(tmp_path / "prep")
  prepare_corpus(corpus, other, "small-vocab", 16, prepared_dir)
  cases.append(((("method", ("simcse",)), ("data.corpus", (prepared_dir,))), "tokenized with 'small-vocab'"))
  for axes, message in cases:
    cfg = _write_sweep_file(tmp_path, tiny_real_dir, corpus, str(tmp_path), axes)
    done = _sweep_cli(f"--config={cfg}", f"--sweep_dir={sweep_dir}")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr[-3000:]
    assert not sweep_dir.exists()  # nothing started, nothing written


@pytest.mark.slow
def test_local_sweep_end_to_end_skip_resume_and_failure(tmp_path, tiny_real_dir, senteval_dir):
  corpus = _corpus(tmp_path, 40)
  sweep_dir = str(tmp_path / "sw")
  cfg = _write_sweep_file(tmp_path, tiny_real_dir, corpus, senteval_dir,
                          (("method", ("simcse", "micse")), ("data.num_sentences", (24,)), ("seed", (0,))))
  done = _sweep_cli(f"--config={cfg}", f"--sweep_dir={sweep_dir}", "--parallel=2")
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  names = ["method=simcse__data.num_sentences=24__seed=0", "method=micse__data.num_sentences=24__seed=0"]
  scores = {}
  for name in names:
    with open(os.path.join(sweep_dir, name, "results.json"), encoding="utf-8") as f:
      scores[name] = json.load(f)["sts"]["tasks"]["STSBenchmark"]["spearman"]
    assert runner.read_status(os.path.join(sweep_dir, name))["status"] == "done"
  with open(os.path.join(sweep_dir, "results.json"), encoding="utf-8") as f:
    rows = json.load(f)["rows"]
  assert [(r["method"], r["n"]) for r in rows] == [("simcse", 1), ("micse", 1)]
  assert [r["scores"]["STSBenchmark"]["mean"] for r in rows] == [scores[n] for n in names]
  _assert_png(os.path.join(sweep_dir, "fewshot_curve.png"))
  _assert_png(os.path.join(sweep_dir, "ablation_deltas.png"))

  # Interrupted between the step-2 and step-4 checkpoints: the disk state of a killed run.
  micse = os.path.join(sweep_dir, names[1])
  shutil.rmtree(os.path.join(micse, "checkpoints", "4"))
  for f in ("results.json", runner.STATUS_FILE):
    os.remove(os.path.join(micse, f))
  again = _sweep_cli(f"--config={cfg}", f"--sweep_dir={sweep_dir}", "--parallel=2")
  assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
  assert f"skip                   {names[0]}" in again.stdout
  assert f"resume from step 2     {names[1]}" in again.stdout
  assert f"started {names[0]}" not in again.stdout
  with open(os.path.join(micse, "results.json"), encoding="utf-8") as f:  # resumed bit-identically
    assert json.load(f)["sts"]["tasks"]["STSBenchmark"]["spearman"] == scores[names[1]]
  assert runner.checkpoint_steps(micse) == [2, 4]

  # A run that fails (subset larger than the corpus) is reported; the other run still finishes.
  cfg = _write_sweep_file(tmp_path, tiny_real_dir, corpus, senteval_dir,
                          (("method", ("simcse",)), ("data.num_sentences", (24, 1000)), ("seed", (0,))))
  failed = _sweep_cli(f"--config={cfg}", f"--sweep_dir={sweep_dir}")
  assert failed.returncode == 1
  bad = "method=simcse__data.num_sentences=1000__seed=0"
  assert f"[sweep]   {bad}: error: " in failed.stderr and "only 40" in failed.stderr
  assert runner.read_status(os.path.join(sweep_dir, bad))["status"] == "failed"
  assert f"`{bad}`: failed — error: " in open(os.path.join(sweep_dir, "results.md"), encoding="utf-8").read()


def test_fewshot_queue_study_is_the_hand_listed_grid(tmp_path):
  """configs/sweeps/fewshot_queue.py: its three variants are the queue study's 8 cells x 3 seeds."""
  cells = set()
  for variant in ("", "baselines", "n1024"):
    sweep = spec.load_config_file(f"configs/sweeps/fewshot_queue.py:{variant}")
    for run in spec.expand(sweep, str(tmp_path / "sw")):
      o = dict(run.overrides)
      masked = o.get("momentum.mask_same_sentence") if run.label("method") in ("micse", "moco_simcse") else None
      cells.add((run.label("method"), o["data.num_sentences"], masked, o["seed"]))
      assert o["num_train_steps"] == 400 and o["batch_size"] == 64 and o["momentum.queue_size"] == 384
      assert o["eval_every"] == 0 and o["eval.final_tasks"] == "sts" and o["data.subset_seed"] == o["seed"]
  grid = [("simcse", 64, None), ("moco_simcse", 64, True), ("moco_simcse", 64, False), ("ami_simcse", 64, None),
          ("micse", 64, True), ("micse", 64, False), ("simcse", 1024, None), ("micse", 1024, True)]
  assert cells == {(m, n, mask, seed) for m, n, mask in grid for seed in (0, 1, 2)}


def test_sweep_report_sums_the_runs_timelines(fake_sweep):
  """Seconds per phase: sum and mean over the runs that wrote timeline.json (hand-computed)."""
  from micse_jax import jsonio, timeline
  sweep_dir, runs = fake_sweep
  jsonio.write_json(os.path.join(runs[0].workdir, "timeline.json"), {"compile_s": 30.0, "train_s": 10.0, "total_s": 50.0})
  jsonio.write_json(os.path.join(runs[5].workdir, "timeline.json"), {"compile_s": 6.0, "data_s": 2.0, "total_s": 20.0})
  document = aggregate.write_reports(runs, sweep_dir, "t")
  times = document["timeline"]
  assert times["n"] == 2 and times["runs"] == sorted([runs[0].name, runs[5].name])
  assert times["phases"]["compile_s"] == {"sum": 36.0, "mean": 18.0}
  assert times["phases"]["train_s"] == {"sum": 10.0, "mean": 5.0}
  assert times["phases"]["total_s"] == {"sum": 70.0, "mean": 35.0}
  assert set(times["phases"]) == set(timeline.KEYS)
  md = open(os.path.join(sweep_dir, "results.md"), encoding="utf-8").read()
  assert "| sum | 36.0 | 2.0 | 0.0 | 10.0 |" in md and "| mean | 18.0 | 1.0 | 0.0 | 5.0 |" in md
