"""Caches that heal themselves: a damaged tokenised corpus or compilation-cache entry is removed
with one warning, recomputed and stored again (the next read is warm); cache files follow the
umask; a killed run's time is on record; a CPU machine with the CUDA plugin starts quietly."""
import glob
import logging
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from micse_jax import cache_healing, caches, jsonio, timeline
from micse_jax.data import token_cache
from micse_jax.data.pipeline import build_train_batches
from micse_jax.tokenization import TOKEN_KEYS, Tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def damage(path: str, how: str) -> None:
  """Damages a file as a full disk, a cut copy or a bad sector would: truncate / cut / flip."""
  data = open(path, "rb").read()
  if how == "truncate":
    data = b""
  elif how == "cut":
    data = data[:len(data) // 2]
  else:  # one bit of a byte in the middle (the stored arrays / the compiled program)
    middle = len(data) // 2
    data = data[:middle] + bytes([data[middle] ^ 0x04]) + data[middle + 1:]
  with open(path, "wb") as f:
    f.write(data)


def _messages(caplog, needle):
  return [r.getMessage() for r in caplog.records if needle in r.getMessage()]


# ---------------------------------------------------------------- tokenised corpus

@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return Tokenizer.from_pretrained(minilm_dir)


def _batches(path, tokenizer, cache_dir):
  return build_train_batches(str(path), tokenizer, max_length=12, global_batch_size=4, seed=0, process_index=0,
                             process_count=1, show_progress=False, cache_dir=cache_dir)


@pytest.mark.parametrize("how", ["truncate", "cut", "flip"])
def test_damaged_token_cache_entry_is_removed_retokenised_and_stored(tmp_path, tokenizer, caplog, monkeypatch, how):
  corpus, cache_dir = tmp_path / "corpus.txt", str(tmp_path / "tokenized")
  sentences = [f"line {i} of the corpus, {'and more ' * (i % 5)}words" for i in range(30)]
  corpus.write_text("\n".join(sentences) + "\n", encoding="utf-8")
  expected = tokenizer(sentences, 12, pad_to=12)  # independent of the cache: the tokenizer itself
  _batches(corpus, tokenizer, cache_dir)
  (entry,) = glob.glob(os.path.join(cache_dir, "*.npz"))
  damage(entry, how)
  with caplog.at_level(logging.WARNING):
    healed = _batches(corpus, tokenizer, cache_dir)  # exits no differently from a fresh cache
  assert len(_messages(caplog, "damaged")) == 1 and entry in _messages(caplog, "damaged")[0]
  for k in TOKEN_KEYS:
    np.testing.assert_array_equal(healed.tokens[k], expected[k])
  np.testing.assert_array_equal(healed.sentence_ids, np.arange(30))
  # stored again: the next run reads it without tokenising and without a warning
  from micse_jax.data import pipeline
  monkeypatch.setattr(pipeline, "tokenize_corpus", lambda *a, **k: pytest.fail("tokenised although cached"))
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    warm = _batches(corpus, tokenizer, cache_dir)
  assert not _messages(caplog, "damaged")
  np.testing.assert_array_equal(warm.tokens["input_ids"], expected["input_ids"])


def test_token_cache_checksum_catches_what_zip_does_not(tmp_path):
  """An entry whose arrays were rewritten consistently for the zip (valid CRC) but not for the
  digest stored beside them, or whose rows disagree, is damaged too."""
  tokens = {k: np.full((4, 3), i + 1) for i, k in enumerate(TOKEN_KEYS)}
  path = token_cache.store(str(tmp_path), "k", tokens, np.arange(4))
  with np.load(path) as entry:
    arrays = {name: entry[name] for name in entry.files}
  arrays["input_ids"] = arrays["input_ids"] + 1  # a changed value under the old digest
  np.savez(path, **arrays)
  assert token_cache.load(str(tmp_path), "k") is None and not os.path.exists(path)
  arrays["input_ids"] = arrays["input_ids"][:3]  # a row short, under a matching digest
  arrays[token_cache.DIGEST_KEY] = token_cache.arrays_digest({k: v for k, v in arrays.items()
                                                              if k != token_cache.DIGEST_KEY})
  np.savez(path, **arrays)
  assert token_cache.load(str(tmp_path), "k") is None and not os.path.exists(path)


# ---------------------------------------------------------------- JAX's compilation cache

@pytest.fixture
def jax_cache(tmp_path, request):
  """JAX's persistent cache in a folder of this test (bounded: LRU + lock; -1: unbounded, no lock),
  put back as it was afterwards."""
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
  max_size = getattr(request, "param", 2**30)
  config = ml_collections.ConfigDict({"cache": {"dir": str(tmp_path), "compilation": True, "tokenized": True,
                                                "compilation_max_size": max_size}})
  folder = caches.enable_compilation_cache(config)
  yield folder
  caches.enable_compilation_cache(ml_collections.ConfigDict({"cache": {"compilation": False}}))
  jax.config.update("jax_compilation_cache_dir", before[0])
  jax.config.update("jax_enable_compilation_cache", before[1])


def _program(x):
  return jnp.tanh(x @ x.T) * 3.0 + x.sum()


def _compile_and_run(x):
  """(result, cache events) of a compile of `_program` that cannot come from memory."""
  events = []
  listener = lambda event, **_: events.append(event.rsplit("/", 1)[-1]) if "compilation_cache/cache_" in event \
      else None
  jax.clear_caches()
  jax.monitoring.register_event_listener(listener)
  try:
    out = np.asarray(jax.jit(_program)(x))
  finally:
    jax.monitoring.unregister_event_listener(listener)
  return out, events


@pytest.mark.parametrize("jax_cache", [2**30, -1], indirect=True, ids=["locked", "unbounded"])
@pytest.mark.parametrize("how", ["truncate", "cut", "flip"])
def test_damaged_compilation_cache_entry_is_removed_compiled_and_stored_again(jax_cache, caplog, how):
  x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
  want = np.tanh(x @ x.T) * 3.0 + x.sum()  # numpy's
  out, events = _compile_and_run(x)
  np.testing.assert_allclose(out, want, rtol=1e-6)
  assert events == ["cache_misses"]
  (entry,) = glob.glob(os.path.join(jax_cache, "*-cache"))
  assert open(entry, "rb").read().startswith(cache_healing.MAGIC)
  damage(entry, how)
  with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as jax_warnings:
    warnings.simplefilter("always")
    out, events = _compile_and_run(x)
  assert len(_messages(caplog, "damaged")) == 1 and entry in _messages(caplog, "damaged")[0]
  assert not [w for w in jax_warnings if "persistent compilation cache" in str(w.message)]  # ours is the one line
  np.testing.assert_allclose(out, want, rtol=1e-6)
  assert events == ["cache_misses"] and cache_healing.unseal(open(entry, "rb").read()) is not None  # written again
  caplog.clear()
  with caplog.at_level(logging.WARNING):
    out, events = _compile_and_run(x)
  assert events == ["cache_hits"] and not _messages(caplog, "damaged")  # the next run is warm
  np.testing.assert_allclose(out, want, rtol=1e-6)


def test_sealed_values_verify_and_plain_ones_pass_through():
  value = bytes(range(256)) * 3
  sealed = cache_healing.seal(value)
  assert cache_healing.unseal(sealed) == value and cache_healing.unseal(value) == value
  assert cache_healing.unseal(sealed[:-1]) is None
  assert cache_healing.unseal(sealed[:40] + bytes([sealed[40] ^ 1]) + sealed[41:]) is None


@pytest.mark.parametrize("umask", [0o002, 0o022])
@pytest.mark.parametrize("jax_cache", [2**30, -1], indirect=True, ids=["locked", "unbounded"])
def test_cache_files_follow_the_umask(jax_cache, tmp_path, umask):
  """Mode 0666 less the umask for both caches: umask 002 lets a group share the folder."""
  old = os.umask(umask)
  try:
    x = np.full((2, 5), umask, np.float32)  # a program (shape) of its own per case
    _compile_and_run(x)
    tokens = token_cache.store(str(tmp_path / "tokenized"), "k", {k: np.ones((2, 3)) for k in TOKEN_KEYS},
                               np.arange(2))
  finally:
    os.umask(old)
  files = [tokens, *glob.glob(os.path.join(jax_cache, "*-cache"))]
  assert len(files) == 2
  for path in files:
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask, path


# ---------------------------------------------------------------- the timeline of a killed run

def test_a_session_is_recorded_at_each_checkpoint_and_replaced_not_added(tmp_path):
  files = [str(tmp_path / "timeline.json"), str(tmp_path / "member_0" / "timeline.json")]
  os.makedirs(tmp_path / "member_0")
  earlier = {"compile_s": 5.0, "total_s": 9.0, "compiles": 2, "steps": {"from": 0, "to": 2}}
  for path in files:
    timeline.add_session(path, earlier)
  session = timeline.Timeline(lambda: files).start()
  try:
    timeline.checkpoint_saved(4)  # before the run recorded its steps: nothing written
    assert jsonio.read_json(files[0])["num_sessions"] == 1
    session.info.update(steps={"from": 2, "to": 2}, finished=False)
    timeline.checkpoint_saved(None)  # a first save still being written: the time recorded, no step claimed
    assert jsonio.read_json(files[0])["sessions"][1]["steps"] == {"from": 2, "to": 2}
    timeline.checkpoint_saved(4)
    timeline.checkpoint_saved(6)
  finally:
    session.finish()
  for path in files:  # what a kill now leaves: the session up to step 6
    document = jsonio.read_json(path)
    assert document["num_sessions"] == 2 and document["sessions"][0] == earlier
    assert document["sessions"][1]["steps"] == {"from": 2, "to": 6} and not document["sessions"][1]["finished"]
    assert document["total_s"] == pytest.approx(9.0 + document["sessions"][1]["total_s"], abs=2e-3)
  session.info["finished"] = True
  session.record()  # the end of the session replaces its entry
  document = jsonio.read_json(files[1])
  assert document["num_sessions"] == 2 and document["sessions"][1]["finished"]


# ---------------------------------------------------------------- a quiet start without a GPU

def _cuda_plugin_without_gpu() -> bool:
  from micse_jax import cli
  try:
    from jax._src import hardware_utils
    no_gpu = not hardware_utils.has_visible_nvidia_gpu()
  except (ImportError, AttributeError):  # another jax: no way to tell, no test
    return False
  plugins = cli._jax_plugins()
  return bool(plugins) and all(p.startswith("xla_cuda") for p in plugins) and no_gpu


def _plain_env():
  env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
  env.pop("JAX_PLATFORMS", None)  # the new user's machine: nothing chosen by hand
  return env


@pytest.mark.skipif(not _cuda_plugin_without_gpu(), reason="needs the CUDA plugin installed and no NVIDIA GPU")
def test_cpu_machine_with_the_cuda_plugin_starts_quietly(tmp_path):
  """A command that starts JAX (the compute dtype is resolved) and then refuses its input: its
  one error line is all it prints (no traceback, no line about the GPU)."""
  done = subprocess.run([sys.executable, "-m", "micse_jax.main", "--config", "micse:demo", "--workdir",
                         str(tmp_path / "w"), "--config.batch_size=-3"], env=_plain_env(), cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 1, done.stderr
  assert "Traceback" not in done.stderr and "cuFFT" not in done.stderr, done.stderr
  assert done.stderr.splitlines() == ["error: invalid config: batch_size must be >= 2, got -3"], done.stderr
  assert done.stdout == ""  # the compute dtype is printed once the input is checked


def test_platform_choice_leaves_a_gpu_and_an_explicit_choice_alone():
  """In fresh processes: CPU only where JAX would pick it anyway (no visible NVIDIA GPU)."""
  script = ("import sys, jax; from jax._src import hardware_utils; from micse_jax import cli;"
            "cli._jax_plugins = lambda: ['xla_cuda13'];"
            "hardware_utils.has_visible_nvidia_gpu = lambda: sys.argv[1] == 'gpu';"
            "print(cli.cpu_when_no_gpu(), repr(jax.config.jax_platforms))")
  outputs = {}
  for case in ("gpu", "none", "explicit"):
    env = _plain_env()
    if case == "explicit":
      env["JAX_PLATFORMS"] = "cuda,cpu"
    done = subprocess.run([sys.executable, "-c", script, case], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    outputs[case] = done.stdout.strip()
  assert outputs == {"gpu": "False None", "none": "True 'cpu'", "explicit": "False 'cuda,cpu'"}



@pytest.mark.gpu  # run by the acceptance kit's part 1 (scripts/device/gpu_tests.py)
def test_compilation_cache_heals_on_the_gpu(jax_cache, caplog):
  """A CUDA program's entry, bit-flipped, heals as a CPU one does."""
  assert jax.default_backend() == "gpu"
  test_damaged_compilation_cache_entry_is_removed_compiled_and_stored_again(jax_cache, caplog, "flip")


@pytest.mark.gpu
def test_gpu_machine_keeps_its_gpu():
  """Where JAX sees an NVIDIA GPU, a program's platform choice leaves it to JAX, which uses the GPU."""
  script = "import jax; from micse_jax import cli; print(cli.cpu_when_no_gpu(), jax.default_backend())"
  done = subprocess.run([sys.executable, "-c", script], env=_plain_env(), cwd=REPO, capture_output=True, text=True,
                        timeout=300)
  assert done.returncode == 0 and done.stdout.split() == ["False", "gpu"], done.stdout + done.stderr


# ---------------------------------------------------------------- both caches damaged, real runs

def _train(config, workdir, env):
  from tests.startup_cost_test import _train_command
  done = subprocess.run(_train_command(config, workdir), env=env, cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  from micse_jax import workdir as workdir_lib
  document = jsonio.read_json(os.path.join(workdir, workdir_lib.TIMELINE_FILE))
  return done.stderr, document["compile_s"], workdir_lib.restore_params(str(workdir), "latest")


@pytest.mark.slow  # three tiny trainings, 45-90 s on the shared 2-core CPU
@pytest.mark.parametrize("how", ["truncate", "cut", "flip"])
def test_run_with_both_caches_damaged_heals_equals_a_fresh_run_and_the_next_is_warm(tmp_path, minilm_dir, how):
  from tests.train_utils import tiny_training_config
  config = tiny_training_config(tmp_path, minilm_dir)
  env = {**_plain_env(), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  _, cold_compile, fresh = _train(config, tmp_path / "fresh", env)
  root = tmp_path / "xdg" / "micse_jax"
  (tokens,) = glob.glob(str(root / "tokenized" / "*.npz"))
  step_program = max(glob.glob(str(root / "jax_compilation_cache" / "*-cache")), key=os.path.getsize)
  damage(tokens, how)
  damage(step_program, how)
  stderr, _, healed = _train(config, tmp_path / "healed", env)
  lines = [line for line in stderr.splitlines() if "damaged" in line]
  assert len(lines) == 2 and tokens in lines[0] + lines[1] and step_program in lines[0] + lines[1], stderr[-3000:]
  assert "Traceback" not in stderr
  stderr, warm_compile, warm = _train(config, tmp_path / "warm", env)
  assert "damaged" not in stderr and warm_compile <= 0.25 * cold_compile, (cold_compile, warm_compile)
  for run in (healed, warm):  # the same steps as with a fresh cache, bit for bit (CPU)
    assert run[0] == fresh[0] == 3
    for a, b in zip(jax.tree.leaves(fresh[1]), jax.tree.leaves(run[1])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
