"""`micse-sweep --population_size auto`: the choice rule on hand-computed memory figures, the run's own
config compiled as a population on this CPU (whose memory analysis is real), the cache, `auto` → 1
on a CPU without a target, per-group sizes, the one-line errors, and the H100 target (extra `aot`)."""
import json
import os
import subprocess
import sys

import ml_collections
import pytest

from micse_jax.studies import population_size as sizing
from micse_jax.studies import spec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
# The CPU cases: with the extra 'aot' installed on a machine without a GPU, JAX's CUDA plugin logs its
# failed start on stderr unless the platform is fixed (a --population_target run fixes it itself).
CPU_ONLY = {**os.environ, "JAX_PLATFORMS": "cpu"}


def _linear(points: dict):
  """Peak bytes by K, linear between the given (K: GiB) points."""
  ks = sorted(points)

  def peak(k):
    lo = max(j for j in ks if j <= k) if k < ks[-1] else ks[-2]
    hi = ks[ks.index(lo) + 1]
    return int((points[lo] + (k - lo) * (points[hi] - points[lo]) / (hi - lo)) * GIB)
  return peak


def test_choose_the_largest_fitting_k_on_the_measured_h100_figures():
  """BERT-base bf16 batch 50 on an H100 (bench --aot: K=1 3.30, K=5 16.4, K=25 64.6 GiB), linear in
  between; budget 54 GiB (0.9 × 0.75 × 80). By hand: K=20 needs 16.4 + 15 × 2.41 = 52.55 GiB, K=21
  54.96 GiB. The rule measures K=1, 2 (6.575), then 16 (42.91: line 1→2 predicts 1 + ⌊50.7/3.275⌋),
  then 20 (line 1→16 predicts 1 + ⌊50.7/2.641⌋), whose line predicts 20 again: four compiles."""
  calls = []
  peak = _linear({1: 3.30, 5: 16.4, 25: 64.6})
  k, peaks = sizing.choose(lambda j: calls.append(j) or peak(j), 40, 54 * GIB)
  assert k == 20 and calls == [1, 2, 16, 20] and sorted(peaks) == calls
  assert peak(20) <= 54 * GIB < peak(21)


def test_choose_stops_at_the_group_size_steps_down_and_refuses_what_never_fits():
  line = lambda j: (3 + 2 * j) * GIB  # K=1 5 GiB, +2 GiB per member
  assert sizing.choose(line, 4, 54 * GIB) == (4, {1: 5 * GIB, 2: 7 * GIB, 4: 11 * GIB})
  assert sizing.choose(line, 2, 54 * GIB)[0] == 2
  # Convex growth: K=2 predicts 1 + ⌊(20 - 2)/3⌋ = 7 (50 GiB, too much); the line 1→7 predicts 1 + ⌊18/8⌋ = 3
  # (10 GiB, fits); the line 1→3 predicts 1 + ⌊18/4⌋ = 5 (26, too much); 1→5 predicts 1 + ⌊18/6⌋ = 4 (17, fits).
  square = lambda j: (1 + j * j) * GIB
  k, peaks = sizing.choose(square, 10, 20 * GIB)
  assert k == 4 and list(peaks) == [1, 2, 7, 3, 5, 4]
  with pytest.raises(spec.SweepError, match="one run's step needs 5.00 GiB per device, more than the budget of "
                     "4.00 GiB: it does not fit even alone"):
    sizing.choose(line, 4, 4 * GIB)


def test_parse_size_accepts_auto_or_a_positive_integer():
  assert sizing.parse_size("auto") is None and sizing.parse_size("AUTO") is None and sizing.parse_size("3") == 3
  for bad in ("0", "-2", "many", "2.5"):
    with pytest.raises(spec.SweepError, match="--population_size must be an integer >= 1 or 'auto'"):
      sizing.parse_size(bad)


def test_h100_target_memory_is_the_datasheet_80_gib_and_tpu_needs_a_capacity():
  from micse_jax.aot import topology
  assert topology.device_memory_bytes("h100") == 80 * GIB and topology.device_memory_bytes("v100") == 32 * GIB
  assert topology.device_memory_bytes("tpu-v5e") is None
  with pytest.raises(spec.SweepError, match="TPU topology does not give the chip's memory; pass --population_device_gib"):
    sizing.target_device("tpu-v5e", 1)
  assert topology.device_memory_bytes("h200") == 141 * GIB  # the H100's compiler target with the H200's memory
  with pytest.raises(spec.SweepError, match="unknown --population_target 'b200'"):
    sizing.target_device("b200", 1)


def test_gpu_memory_fraction_follows_the_environment(monkeypatch):
  monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
  assert sizing.gpu_memory_fraction()[1] == 0.75
  monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".9")
  assert sizing.gpu_memory_fraction() == ("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.9)


def _sweep(model_dir, seeds=(0, 1, 2), extra=()):
  return ml_collections.ConfigDict({
      "name": "t", "base_config": "configs/micse.py", "num_train_steps": 10, "eval_tasks": "STSBenchmark",
      "overrides": (("model.name_or_path", model_dir), ("batch_size", 8), ("model.max_length", 16),
                    ("momentum.queue_size", 16), ("ami.layers", (0, 1)), ("ami.heads_per_slice", 1)) + tuple(extra),
      "axes": (("data.num_sentences", (8, 16)), ("seed", seeds))})


def test_auto_is_one_program_per_run_on_a_cpu_without_a_target(tmp_path):
  runs = spec.expand(_sweep("unused"), str(tmp_path))
  assert sizing.local_device() is None  # the test machine has no accelerator
  choices = sizing.choose_sizes(spec.population_groups(runs), None, 0.9, sizing.Cache(str(tmp_path)))
  assert [c.k for c in choices] == [1, 1]
  assert "no accelerator here and no --population_target" in sizing.plan_lines(choices, None)[0]
  assert not os.path.exists(tmp_path / sizing.CACHE_FILE)  # nothing measured, nothing written


def test_sizes_per_group_and_the_cache_is_reused(tmp_path, monkeypatch):
  """Per group: 3 seeds of size 8 and 3 of size 16 share one measurement (data.* does not change the
  step); K=3 fits 10 GiB of 20 × 0.5 at 1 + 3 GiB; K=2 when only 8 GiB of 16 fit. Run again: no compile."""
  compiled = []
  monkeypatch.setattr(sizing, "compiled_peak", lambda config, device, k: compiled.append(k) or (1 + 3 * k) * GIB)
  runs = spec.expand(_sweep("unused"), str(tmp_path))
  device = sizing.Device((), 20 * GIB, "test device", "a test")
  choices = sizing.choose_sizes(spec.population_groups(runs), device, 0.5, sizing.Cache(str(tmp_path)))
  assert [c.k for c in choices] == [3, 3] and compiled == [1, 2, 3]
  assert [c.compiles for c in choices] == [3, 0]
  small = sizing.Device((), 16 * GIB, "test device", "a test")
  again = sizing.choose_sizes(spec.population_groups(runs), small, 0.5, sizing.Cache(str(tmp_path)))
  assert [c.k for c in again] == [2, 2] and compiled == [1, 2, 3]  # from the cache file
  assert "[cached]" in sizing.plan_lines(again, small)[1] and "K=3 needs 10.00 GiB" in again[0].reason
  with open(tmp_path / sizing.CACHE_FILE, encoding="utf-8") as f:
    assert json.load(f)["chosen"] == {"data.num_sentences=8__seed=0": 2, "data.num_sentences=16__seed=0": 2}
  launched, _ = spec.group_populations(runs, sizing.Cache(str(tmp_path)).chosen(), str(tmp_path))
  assert [r.name for r in launched] == ["data.num_sentences=8__seeds=(0,1)", "data.num_sentences=8__seed=2",
                                        "data.num_sentences=16__seeds=(0,1)", "data.num_sentences=16__seed=2"]
  (tmp_path / "broken").mkdir()
  (tmp_path / "broken" / sizing.CACHE_FILE).write_text("{", encoding="utf-8")
  with pytest.raises(spec.SweepError, match="population_size.json is unreadable .*; delete it to measure again"):
    sizing.Cache(str(tmp_path / "broken"))
  # Another device (or jax version, or a config field that shapes the step) is another measurement.
  other = sizing.Device((), 20 * GIB, "other device", "a test")
  sizing.choose_sizes(spec.population_groups(runs), other, 0.5, sizing.Cache(str(tmp_path)))
  assert compiled == [1, 2, 3, 1, 2, 3]


@pytest.mark.parametrize("field", ["mesh.shard_state", "mesh.shard_update"])
def test_groups_the_trainer_refuses_as_populations_stay_solo_without_a_compile(tmp_path, monkeypatch, field):
  """What `config_checks.check_population` refuses (each member's state whole: no FSDP, no sharded
  update) is K = 1 with the trainer's reason, decided before any compile; the launch then keeps the
  runs solo instead of failing on the population it would have built."""
  monkeypatch.setattr(sizing, "compiled_peak", lambda *a: pytest.fail("nothing to measure"))
  device, cache = sizing.Device((), 20 * GIB, "d", "a test"), sizing.Cache(str(tmp_path))
  refused = spec.expand(_sweep("unused", extra=((field, True),)), str(tmp_path))
  single = spec.expand(_sweep("unused", seeds=(0,)), str(tmp_path))
  groups = spec.population_groups(refused + single[:1])
  choices = sizing.choose_sizes(groups, device, 0.9, cache)
  assert [c.k for c in choices] == [1, 1, 1] and choices[2].reason == "one run in the group"
  for choice in choices[:2]:
    assert choice.reason.startswith("refused as a population by the trainer's checks: ")
    assert f"{field}=True is not supported with population.seeds" in choice.reason
  launched, _ = spec.group_populations(refused, {g[0].name: c.k for g, c in zip(groups, choices)}, str(tmp_path))
  assert [r.name for r in launched] == [r.name for r in refused]  # six solo runs, no error
  with pytest.raises(spec.SweepError, match=f"{field}=True is not supported"):  # what a K > 1 would have met
    spec.group_populations(refused, 2, str(tmp_path))


@pytest.mark.slow  # two compiles: ~15 s each on an idle 2-core CPU, ~25 s under load
def test_the_runs_own_config_compiles_as_a_population_on_this_cpu(tmp_path, tiny_real_dir):
  """The real compile (tiny 2-layer BERT, batch 8 × 16 tokens, the sweep's miCSE config): a second
  member adds at least its float32 train state (params, EMA encoder, two Adam moments) to the peak."""
  run = spec.expand(_sweep(tiny_real_dir), str(tmp_path))[0]
  device = sizing.local_device(1.0)
  config = sizing.run_config(run)
  one, two = (sizing.compiled_peak(config, device, k) for k in (1, 2))
  with open(os.path.join(tiny_real_dir, "config.json"), encoding="utf-8") as f:
    c = json.load(f)
  h, i, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
  encoder = (c["vocab_size"] + c["max_position_embeddings"] + c["type_vocab_size"] + 2) * h + layers * (
      4 * (h * h + h) + 4 * h + (h * i + i) + (i * h + h)) + h * h + h  # embeddings, layers, pooler
  state_bytes = 4 * (3 * encoder + encoder)  # params + two Adam moments (+ head), and the EMA encoder
  assert two - one >= state_bytes
  assert one < two < 3 * one


def _cli(tmp_path, *args):
  cfg = tmp_path / "sweep_cfg.py"
  cfg.write_text('''import ml_collections
def get_config(arg=None):
  return ml_collections.ConfigDict({"name": "t", "base_config": "configs/micse.py", "num_train_steps": 10,
      "eval_tasks": "STSBenchmark", "overrides": (("batch_size", 4),), "step_ms": 10.0,
      "axes": (("data.num_sentences", (8,)), ("seed", (0, 1, 2)))})
''', encoding="utf-8")
  return subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={cfg}", "--dry_run",
                         f"--sweep_dir={tmp_path / 'sw'}", *args], cwd=REPO, capture_output=True, text=True,
                        timeout=600, env=CPU_ONLY)


def test_cli_auto_on_this_cpu_and_one_line_errors(tmp_path):
  done = _cli(tmp_path)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "[sweep] population size auto → 1: no accelerator here" in done.stdout
  assert "3 runs, 0 finished, 3 to run" in done.stdout
  cases = [(("--population_size=0",), "--population_size must be an integer >= 1 or 'auto', got '0'"),
           (("--population_memory_use=1.5",), "--population_memory_use must be in (0, 1], got 1.5"),
           (("--population_target=tpu-v5e",), "--population_target tpu-v5e: the TPU topology does not give"),
           (("--population_size=2", "--population_target=h100"), "they do not combine with --population_size 2")]
  for args, message in cases:
    failed = _cli(tmp_path, *args)
    lines = failed.stderr.strip().splitlines()
    assert failed.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), failed.stderr[-2000:]
    assert message in lines[0]


def _tiny_sweep_file(tmp_path, model_dir):
  """A sweep file: the tiny model's miCSE run × seeds 0, 1, 2 (one group)."""
  path = tmp_path / "tiny_sweep.py"
  path.write_text(f'''import ml_collections
def get_config(arg=None):
  return ml_collections.ConfigDict({{"name": "t", "base_config": "configs/micse.py", "num_train_steps": 10,
      "eval_tasks": "STSBenchmark", "step_ms": 10.0, "overrides": {_sweep(model_dir).overrides!r},
      "axes": (("seed", (0, 1, 2)),)}})
''', encoding="utf-8")
  return path


@pytest.mark.slow
def test_cli_auto_end_to_end_on_this_cpu_with_a_given_capacity(tmp_path, tiny_real_dir):
  """The whole path: compile on this CPU against --population_device_gib; a capacity between K=2's and
  K=3's peak gives K=2 from the cache; a capacity below one run's peak is one error line."""
  sweep_file = _tiny_sweep_file(tmp_path, tiny_real_dir)
  sweep_dir = tmp_path / "sw"

  def cli(*args):
    return subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={sweep_file}", "--dry_run",
                           f"--sweep_dir={sweep_dir}", *args], cwd=REPO, capture_output=True, text=True, timeout=900,
                          env=CPU_ONLY)
  first = cli("--population_device_gib=100")
  assert first.returncode == 0, first.stderr[-3000:]
  assert "K=3" in first.stdout and "[3 compile(s)" in first.stdout
  assert "all 3 runs of the group fit (memory for about" in first.stdout
  assert "seeds=(0,1,2)" in first.stdout and "3 member runs in 1 programs, a 3-member step" in first.stdout
  peaks = next(iter(json.load(open(sweep_dir / sizing.CACHE_FILE, encoding="utf-8"))["peaks"].values()))
  gib = (int(peaks["2"]) + int(peaks["3"])) / 2 / 0.9 / GIB  # K=2 fits 90 % of it, K=3 does not
  second = cli(f"--population_device_gib={gib}")
  assert second.returncode == 0, second.stderr[-3000:]
  assert "K=2 " in second.stdout and "[cached]" in second.stdout and "seeds=(0,1)" in second.stdout
  tiny = int(peaks["1"]) / 2 / GIB
  failed = cli(f"--population_device_gib={tiny}")
  lines = failed.stderr.strip().splitlines()
  assert failed.returncode == 2 and len(lines) == 1 and "does not fit even alone" in lines[0], failed.stderr[-3000:]


@pytest.mark.slow
def test_h100_target_sizes_the_tiny_run_deviceless(tmp_path, tiny_real_dir):
  """`--population_target h100` (its own process: the CUDA topology needs JAX on the CPU platform from
  the start): capacity 80 GiB × JAX's 0.75, three compiles, all three seeds in one population."""
  pytest.importorskip("jax_cuda13_plugin", reason="needs the extra 'aot' (pip install 'micse-jax[aot]')")
  sweep_file = _tiny_sweep_file(tmp_path, tiny_real_dir)
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")}
  done = subprocess.run([sys.executable, "-m", "micse_jax.sweep", f"--config={sweep_file}", "--dry_run",
                         f"--sweep_dir={tmp_path / 'sw'}", "--population_target=h100"], cwd=REPO, capture_output=True,
                        text=True, timeout=900, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "population size auto on 1 × h100 (compiled deviceless):" in done.stdout
  assert ("budget 54.00 GiB (0.9 × 60.00 GiB: h100 device_memory_size 80.00 GiB × 0.75 (JAX's default memory "
          "fraction))") in done.stdout
  assert "all 3 runs of the group fit (memory for about" in done.stdout and "[3 compile(s)" in done.stdout
  assert "seeds=(0,1,2)" in done.stdout


def test_the_sweeps_backend_starts_without_preallocation_and_leaves_the_runs_environment(monkeypatch):
  """The sweep's process must not take 75 % of a GPU; the runs it starts keep JAX's default."""
  monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
  seen = []
  monkeypatch.setattr("jax.local_devices", lambda: seen.append(os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE")) or [])
  sizing.start_backend(None)
  assert seen == ["false"] and "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
  sizing.start_backend(None)
  assert seen == ["false", "false"] and os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
