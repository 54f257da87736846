"""Population training: member i equals the solo run of its seed (1 and 4 devices), a non-finite
member stops alone, the config checks, the workdir layout and convert/evaluate of a member."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from micse_jax import config_checks
from micse_jax.configs import population_fields
from micse_jax.errors import ConfigError
from micse_jax.training import non_finite, population, population_placement
from tests.helpers import fake_devices_env
from tests.population_utils import compared_parts, max_difference, run_population, run_solo
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOLERANCE = 2e-5  # float32: vmapped (batched) kernels may round differently from the solo ones


def _population_config(tmp_path, minilm_dir, steps=20, **population_fields):
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=steps)
  for key, value in population_fields.items():
    config.population[key] = value
  return config


def test_member_configs_are_the_solo_configs(tmp_path, minilm_dir):
  config = _population_config(tmp_path, minilm_dir, seeds=(1, 2, 3), subset_seeds=(7, 8, 9), num_sentences=32)
  members = population_fields.member_configs(config)
  assert [m.seed for m in members] == [1, 2, 3]
  assert [m.data.subset_seed for m in members] == [7, 8, 9]
  assert {m.data.num_sentences for m in members} == {32}
  solo = tiny_training_config(tmp_path, minilm_dir, num_train_steps=20, seed=2, **{"data.subset_seed": 8,
                                                                                   "data.num_sentences": 32})
  assert members[1].to_dict() == solo.to_dict()  # nothing else differs from the solo run


@pytest.mark.slow  # ~80 s on the shared 2-core CPU; the default run checks equality in test_a_non_finite_member_stops_alone
def test_each_member_equals_its_solo_run_after_20_steps(tmp_path, minilm_dir):
  """Own seeds (head init, dropout, AMI and momentum keys, data order) and own few-shot subsets."""
  config = _population_config(tmp_path, minilm_dir, seeds=(1, 2), subset_seeds=(4, 5), num_sentences=40)
  pstate, history = run_population(config, 20)
  assert int(pstate.step) == 20 and list(pstate.stopped_at) == [-1, -1]
  finals = []
  for i, member_config in enumerate(population_fields.member_configs(config)):
    solo, losses = run_solo(member_config, 20)
    np.testing.assert_allclose([float(h["loss"][i]) for h in history], losses, rtol=1e-5, atol=1e-6)
    assert max_difference(compared_parts(population.member(pstate.members, i)), compared_parts(solo)) < TOLERANCE
    finals.append(solo)
  # the members are different runs: their heads start apart and their queues hold other sentences
  assert max_difference(finals[0].params["head"], finals[1].params["head"]) > 1e-3
  assert not np.array_equal(finals[0].queue.ids, finals[1].queue.ids)


@pytest.mark.slow  # ~40 s: two solo runs and a population of two, 3 steps each
def test_each_member_equals_its_solo_run_with_the_rbg_dropout_generator(tmp_path, minilm_dir):
  """`model.rng_impl=rbg`: under the population's vmap each member draws its dropout masks from its
  own key (models/dropout.py), as its solo run does; XLA's batched RngBitGenerator alone would
  give member 2 a slice of member 1's draw."""
  config = _population_config(tmp_path, minilm_dir, steps=3, seeds=(1, 2))
  config.model.rng_impl = "rbg"
  pstate, history = run_population(config, 3)
  for i, member_config in enumerate(population_fields.member_configs(config)):
    solo, losses = run_solo(member_config, 3)
    np.testing.assert_allclose([float(h["loss"][i]) for h in history], losses, rtol=1e-5, atol=1e-6)
    assert max_difference(compared_parts(population.member(pstate.members, i)), compared_parts(solo)) < TOLERANCE


def test_a_non_finite_member_stops_alone(tmp_path, minilm_dir):
  """Member 1's absurd learning rate (a per-member peak: the same program) makes it non-finite;
  it keeps its last finite state, members 0 and 2 go on. Member 2, with its own learning rate (a
  per-member array), equals its solo run (lr 2e-3)."""
  config = _population_config(tmp_path, minilm_dir, steps=6, seeds=(1, 2, 3), learning_rates=(1e-3, 1e12, 2e-3))
  config.optim.grad_clip_norm = 0.0
  config.optim.warmup_steps = 0
  pstate, history = run_population(config, 6)
  stopped = [int(s) for s in pstate.stopped_at]
  assert stopped[0] == stopped[2] == -1 and 0 <= stopped[1] < 6
  member1 = population.member(pstate.members, 1)
  assert int(member1.step) == stopped[1]  # nothing applied from the bad step on
  assert all(np.isfinite(np.asarray(x)).all() for x in np.asarray(member1.params["head"]["dense"]["kernel"]))
  line = non_finite.stopped_line(1, 2, stopped[1], 2)
  assert "\n" not in line and "member 1 (seed 2) stopped" in line
  assert int(population.member(pstate.members, 0).step) == 6
  solo_config = population_fields.member_config(config, 2)
  assert solo_config.optim.learning_rate == 2e-3
  solo, _ = run_solo(solo_config, 6)
  assert max_difference(compared_parts(population.member(pstate.members, 2)), compared_parts(solo)) < TOLERANCE


@pytest.mark.slow  # 18 s of the default run (CI budget); test_a_non_finite_member_stops_alone stays
def test_a_per_member_ami_weight_is_the_same_program_as_a_constant_one(tmp_path, minilm_dir):
  """population.ami_weights=(0, 0.3): member 1 is bit for bit the member of seed 3 in a population
  whose ami.weight is the constant 0.3; member 0's loss is its InfoNCE alone (λ = 0)."""
  config = _population_config(tmp_path, minilm_dir, steps=3, seeds=(2, 3), ami_weights=(0.0, 0.3))
  assert [m.ami.weight for m in population_fields.member_configs(config)] == [0.0, 0.3]
  per_member, history = run_population(config, 3)
  constant = _population_config(tmp_path, minilm_dir, steps=3, seeds=(2, 3))
  constant.ami.weight = 0.3
  reference, reference_history = run_population(constant, 3)
  assert max_difference(compared_parts(population.member(per_member.members, 1)),
                        compared_parts(population.member(reference.members, 1))) == 0.0
  assert [float(h["loss"][1]) for h in history] == [float(h["loss"][1]) for h in reference_history]
  for h in history:
    assert float(h["loss"][0]) == pytest.approx(float(h["infonce"][0]), rel=1e-6) and float(h["ami_mi"][0]) > 0


@pytest.mark.parametrize("fields, message", [
    ({"seeds": (1, 1)}, "distinct"),
    ({"seeds": (1, 2), "subset_seeds": (3,)}, "one data.subset_seed per member"),
    ({"subset_seeds": (3,)}, "need population.seeds"),
    ({"seeds": (1, 2), "learning_rates": (1e-3, -1.0)}, "learning_rates"),
    ({"seeds": (1, 2), "ami_weights": (1e-3,)}, "ami_weights"),
])
def test_bad_population_fields_are_one_line(tmp_path, minilm_dir, fields, message):
  config = _population_config(tmp_path, minilm_dir, **fields)
  with pytest.raises(ConfigError, match=message) as error:
    config_checks.check_config(config)
  assert "\n" not in str(error.value)


@pytest.mark.slow  # ~100 s on the shared 2-core CPU: three 4-device compiles
def test_four_devices_spread_members_or_split_their_rows_and_resume_a_one_device_checkpoint(tmp_path, minilm_dir):
  env = fake_devices_env(4)
  out = subprocess.run([sys.executable, "-m", "tests.population_worker", str(tmp_path), minilm_dir],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  assert result["num_devices"] == 4
  assert result["spread"]["mesh"] == ["member"] and result["split"]["mesh"] == ["data"]
  assert result["spread"]["max_diff"] < TOLERANCE and result["split"]["max_diff"] < TOLERANCE
  assert result["spread"]["collectives"] == []  # members exchange nothing
  assert result["restored_4dev_max_diff"] == 0.0  # a 1-device checkpoint resumes split over 4 devices
  assert result["restored_shardings"] == ["member"]  # every stacked leaf split by member


def _restored_member(workdir, index, which="latest"):
  from micse_jax import workdir as workdir_lib
  return workdir_lib.restore_params(workdir_lib.member_workdir(workdir, index), which)


@pytest.mark.slow  # 66-87 s on the shared 2-core CPU: preempted + resumed population, a solo run, evaluations
def test_population_workdir_resumes_and_each_member_folder_is_a_workdir(tmp_path, minilm_dir, senteval_dir,
                                                                         monkeypatch):
  """Preempted after its first save and resumed; member 1's folder reads like the solo run of
  seed 2 (its config.json, its latest params = the solo run's), with its own dev selection
  (`best/`), results.json and timeline; micse-convert / micse-evaluate take `--member`."""
  from micse_jax import convert
  from micse_jax import workdir as workdir_lib
  from micse_jax.evaluation import command as evaluate
  from micse_jax.training import checkpoint, trainer
  from tests.train_utils import train_preempted_after_first_save
  config = _population_config(tmp_path, minilm_dir, steps=6, seeds=(1, 2))
  config.checkpoint_every, config.eval_every = 3, 3
  config.eval.senteval_dir, config.eval.final_tasks = senteval_dir, "STSBenchmark"
  workdir = str(tmp_path / "population")
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, workdir)
  results = trainer.train_and_evaluate(config, workdir)
  assert len(results["members"]) == 2
  solo_config = population_fields.member_config(config, 1)
  solo_config.eval_every, solo_config.eval.final_tasks = 0, ""
  solo = str(tmp_path / "solo")
  trainer.train_and_evaluate(solo_config, solo)
  step, params = _restored_member(workdir, 1)
  solo_step, solo_params = workdir_lib.restore_params(solo, "latest")
  assert step == solo_step == 6 and max_difference(params, solo_params) < TOLERANCE
  for i in (0, 1):
    folder = workdir_lib.member_dir(workdir, i)
    saved = workdir_lib.read_run_config(folder)
    assert saved["seed"] == (1, 2)[i] and saved["population"]["seeds"] == []
    assert workdir_lib.is_workdir(folder) and workdir_lib.has_steps(os.path.join(folder, workdir_lib.BEST_DIR))
    assert json.load(open(os.path.join(folder, workdir_lib.RESULTS_FILE)))["settings"]["checkpoint"].startswith("best")
    assert len(json.load(open(os.path.join(folder, workdir_lib.TIMELINE_FILE)))["sessions"]) == 2  # run + resume
  out = convert.convert(output=str(tmp_path / "export1"), workdir=workdir, member=1)
  from micse_jax.models.loading import load_pretrained
  exported = load_pretrained(out)[1]
  np.testing.assert_allclose(exported["embeddings"]["word_embeddings"]["embedding"],
                             params["encoder"]["embeddings"]["word_embeddings"]["embedding"], rtol=1e-6)
  with pytest.raises(convert.ConvertError, match="out of range"):
    convert.convert(output=str(tmp_path / "export5"), workdir=workdir, member=5)
  with pytest.raises(convert.ConvertError, match="not a population workdir"):
    convert.convert(output=str(tmp_path / "export_solo"), workdir=solo, member=0)
  from types import SimpleNamespace
  values = SimpleNamespace(model=workdir, member=0, checkpoint="best", tasks="STSBenchmark", pooler="cls_before_pooler",
                           output=None, senteval_dir=senteval_dir, download=False, fast=False, seed=1111,
                           batch_size=128, max_length=128, transfer_protocol="senteval")  # the trainer's
  document = evaluate.evaluate_and_report(values)
  member0 = json.load(open(os.path.join(workdir_lib.member_dir(workdir, 0), workdir_lib.RESULTS_FILE)))
  assert document["sts"] == member0["sts"]  # the member's best params, scored again by micse-evaluate


def test_sweep_groups_runs_that_differ_only_in_seeds(tmp_path):
  """`micse-sweep --population_size 2`: seeds (0, 1, 2) of each size → a population of (0, 1) and
  the solo run 2; the members are the solo runs (same configs), reported from their member folders."""
  import ml_collections

  from micse_jax.studies import spec
  sweep = ml_collections.ConfigDict({"name": "t", "base_config": "configs/micse.py", "num_train_steps": 100,
                                     "eval_tasks": "STSBenchmark", "overrides": (("batch_size", 4),),
                                     "axes": (("data.num_sentences", (8, 16)), ("seed", (0, 1, 2)))})
  runs = spec.expand(sweep, str(tmp_path))
  launched, reported = spec.group_populations(runs, 2, str(tmp_path))
  assert [r.name for r in launched] == ["data.num_sentences=8__seeds=(0,1)", "data.num_sentences=8__seed=2",
                                        "data.num_sentences=16__seeds=(0,1)", "data.num_sentences=16__seed=2"]
  pop = launched[0]
  assert pop.override("population.seeds") == (0, 1) and pop.override("population.subset_seeds") == (0, 1)
  assert pop.override("seed") is None and "--config.population.seeds=(0,1)" in spec.main_command(pop)
  assert [r.name for r in reported] == [r.name for r in runs]
  assert reported[1].workdir == os.path.join(pop.workdir, "members", "1") and reported[2] == runs[2]

  def built(run):
    config = spec.load_config_file(run.config_file)
    for key, value in run.overrides:
      spec.set_field(config, key, value, run.config_file)
    return config
  assert population_fields.member_config(built(pop), 1).to_dict() == built(runs[1]).to_dict()
  # GPU-hours: a 2-member step costs 2 × 10 ms unless a measured figure is given
  assert spec.estimated_gpu_hours(launched, 10.0) == (400, pytest.approx((2 * 100 * 20 + 2 * 100 * 10) / 3.6e6))
  assert spec.estimated_gpu_hours(launched, 10.0, 1, None, {2: 12.0})[1] == pytest.approx(4400 / 3.6e6)
  assert spec.group_populations(runs, 1, str(tmp_path)) == (runs, runs)


@pytest.mark.parametrize("k, devices, expected", [
    (0, 8, 8),   # a solo run: its rows over every device
    (8, 8, 1),   # spread one member a device: a member's rows stay whole, no padding
    (16, 8, 1),  # two members a device
    (2, 4, 4),   # members the devices do not divide: each member's rows split over all of them
    (4, 1, 1),
])
def test_a_runs_batch_is_padded_to_the_devices_its_rows_are_split_over(k, devices, expected):
  assert population_placement.row_devices(k, devices) == expected


def test_prepared_runs_pad_each_members_batches_as_the_program_pads_its_rows(monkeypatch):
  """`run_inputs.prepare_runs` (the trainer's, the bench's, the tests') hands `run_inputs.prepare` the
  padding multiple `program.build` pads the rows to (`population_placement.row_devices`)."""
  from micse_jax.configs import micse
  from micse_jax.training import run_inputs
  seen = []
  monkeypatch.setattr(run_inputs, "prepare", lambda config, row_devices=None: seen.append(row_devices))
  config = micse.get_config()
  run_inputs.prepare_runs(config, devices=[object()] * 4)
  config.population.seeds = (1, 2, 3, 4)
  run_inputs.prepare_runs(config, devices=[object()] * 4)
  config.population.seeds = (1, 2)
  run_inputs.prepare_runs(config, devices=[object()] * 4)
  assert seen == [4] + [1] * 4 + [4] * 2
