"""Issue 27, parts 1-2: a run's timeline, and fixed costs paid once (compilation cache, tokenised
corpus cache, dev evaluation compiled once per run)."""
import os
import subprocess
import sys
import time

import jax
import ml_collections
import numpy as np
import pytest

from micse_jax import caches, config_checks, jsonio, timeline
from micse_jax import workdir as workdir_lib
from micse_jax.data import token_cache
from micse_jax.data.pipeline import build_train_batches
from micse_jax.errors import ConfigError
from micse_jax.tokenization import TOKEN_KEYS, Tokenizer
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_timeline_attributes_time_to_phases_minus_compiles():
  """Nested phases take their own share; compile spans (overlapping ones counted once) are
  subtracted from the phase they fall in and summed into compile_s."""
  session = timeline.Timeline()  # not started: the compile spans are fed by hand
  with session.phase("data"):
    time.sleep(0.2)
    with session.phase("save"):
      time.sleep(0.1)
  with session.phase("train"):
    start = time.time()
    time.sleep(0.3)
    session._on_span(timeline.COMPILE_EVENTS[0], start, start + 0.2)
    session._on_span(timeline.COMPILE_EVENTS[2], start + 0.1, start + 0.25)  # overlaps the first
    session._on_span("/jax/some/other_event", start, start + 0.3)  # not a compile
  out = session.finish()
  assert out["compile_s"] == pytest.approx(0.25, abs=0.01)
  assert out["data_s"] == pytest.approx(0.2, abs=0.05)
  assert out["save_s"] == pytest.approx(0.1, abs=0.05)
  assert out["train_s"] == pytest.approx(0.05, abs=0.05)
  assert out["compiles"] == 1  # backend compiles (or cache reads) only
  parts = sum(out[f"{p}_s"] for p in timeline.PHASES) + out["compile_s"]
  assert parts == pytest.approx(out["total_s"], abs=0.01)
  assert out["total_s"] == pytest.approx(0.6, abs=0.1)


def test_timeline_sessions_accumulate(tmp_path):
  """A resume adds a session; the top level is the sum over sessions."""
  path = str(tmp_path / "timeline.json")
  first = {"compile_s": 10.0, "train_s": 5.0, "total_s": 20.0, "compiles": 3}
  second = {"compile_s": 1.5, "train_s": 4.0, "eval_s": 2.0, "total_s": 9.0, "compiles": 3}
  timeline.add_session(path, first)
  document = timeline.add_session(path, second)
  assert jsonio.read_json(path) == document
  assert document["num_sessions"] == 2 and document["sessions"] == [first, second]
  assert (document["compile_s"], document["train_s"], document["eval_s"], document["total_s"]) == (11.5, 9.0, 2.0, 29.0)
  assert document["compiles"] == 6
  assert "compile 11.5 s" in timeline.one_line(document) and "(2 sessions)" in timeline.one_line(document)


def _cache_config(**fields):
  group = {"dir": "", "compilation": True, "tokenized": True, "compilation_max_size": 2**30}
  return ml_collections.ConfigDict({"cache": {**group, **fields}})


def test_cache_folders_follow_xdg_and_config(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  root = os.path.join(str(tmp_path), "xdg", "micse_jax")
  assert caches.compilation_cache_dir(_cache_config()) == os.path.join(root, "jax_compilation_cache")
  assert caches.tokenized_cache_dir(_cache_config()) == os.path.join(root, "tokenized")
  assert caches.tokenized_cache_dir(_cache_config(tokenized=False)) is None
  assert caches.compilation_cache_dir(_cache_config(compilation=False)) is None
  moved = str(tmp_path / "elsewhere")
  assert caches.compilation_cache_dir(_cache_config(dir=moved)) == os.path.join(moved, "jax_compilation_cache")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert caches.user_cache_root() == os.path.join(str(tmp_path), "home", ".cache", "micse_jax")


def test_cache_fields_are_checked():
  from micse_jax.configs import default
  config = default.get_config()
  config_checks.check_fields(config)
  for field, bad in (("dir", 3), ("compilation", "yes"), ("compilation_max_size", 0), ("tokenized", 1)):
    broken = ml_collections.ConfigDict(default.get_config().to_dict(), type_safe=False)
    broken.cache[field] = bad
    with pytest.raises(ConfigError, match=f"cache.{field}"):
      config_checks.check_fields(broken)


def test_disabled_compilation_cache_turns_jax_cache_off(tmp_path):
  before = (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache)
  try:
    assert caches.enable_compilation_cache(_cache_config(compilation=False)) is None
    assert jax.config.jax_compilation_cache_dir is None and not jax.config.jax_enable_compilation_cache
    folder = caches.enable_compilation_cache(_cache_config(dir=str(tmp_path)))
    assert folder == jax.config.jax_compilation_cache_dir == str(tmp_path / "jax_compilation_cache")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
  finally:
    caches.enable_compilation_cache(_cache_config(compilation=False))
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_enable_compilation_cache", before[1])


@pytest.fixture(scope="module")
def tokenizer(minilm_dir):
  return Tokenizer.from_pretrained(minilm_dir)


def _corpus(path, count, word="alpha"):
  lines = [f"{word} sentence {i} with {'more ' * (i % 9)}words" for i in range(count)]
  lines[5] = lines[2]  # a duplicate: shares its first occurrence's id
  path.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n", encoding="utf-8")
  return [line for line in lines]


def _batches(path, tokenizer, cache_dir, **kw):
  return build_train_batches(str(path), tokenizer, max_length=12, global_batch_size=4, seed=0,
                             process_index=0, process_count=1, show_progress=False, cache_dir=cache_dir, **kw)


def test_token_cache_equals_fresh_tokens_and_follows_the_file(tmp_path, tokenizer):
  corpus, cache_dir = tmp_path / "corpus.txt", str(tmp_path / "tokenized")
  sentences = _corpus(corpus, 40)
  expected = tokenizer(sentences, 12, pad_to=12)  # independent: the tokenizer itself
  first = _batches(corpus, tokenizer, cache_dir)
  entries = os.listdir(cache_dir)
  assert len(entries) == 1 and entries[0].endswith(".npz")
  entry = token_cache.load(cache_dir, entries[0][:-4])
  assert entry is not None
  for k in TOKEN_KEYS:
    np.testing.assert_array_equal(entry[0][k], expected[k])
    np.testing.assert_array_equal(first.tokens[k], expected[k])
  ids = np.arange(40)
  ids[5] = 2
  np.testing.assert_array_equal(entry[1], ids)
  # a second run reads the entry (tokenising is made to fail) and gets the same batches
  second = _run_without_tokenizing(corpus, tokenizer, cache_dir)
  for step in range(3):
    for k, v in first.batch(step).items():
      np.testing.assert_array_equal(second.batch(step)[k], v)
  # a few-shot subset is cut from the cached corpus, as from a fresh tokenisation
  subset = _run_without_tokenizing(corpus, tokenizer, cache_dir, num_sentences=8, subset_seed=3)
  fresh = _batches(corpus, tokenizer, None, num_sentences=8, subset_seed=3)
  for k in TOKEN_KEYS:
    np.testing.assert_array_equal(subset.tokens[k], fresh.tokens[k])
  np.testing.assert_array_equal(subset.sentence_ids, fresh.sentence_ids)
  # an edited file gets its own entry with its own tokens
  changed = _corpus(corpus, 40, word="beta")
  third = _batches(corpus, tokenizer, cache_dir)
  assert len(os.listdir(cache_dir)) == 2
  np.testing.assert_array_equal(third.tokens["input_ids"], tokenizer(changed, 12, pad_to=12)["input_ids"])
  assert not np.array_equal(third.tokens["input_ids"], first.tokens["input_ids"])


def _run_without_tokenizing(corpus, tokenizer, cache_dir, **kw):
  from micse_jax.data import pipeline
  real = pipeline.tokenize_corpus
  pipeline.tokenize_corpus = lambda *a, **k: pytest.fail("tokenised although the corpus is cached")
  try:
    return _batches(corpus, tokenizer, cache_dir, **kw)
  finally:
    pipeline.tokenize_corpus = real


def test_disabled_token_cache_writes_nothing(tmp_path, tokenizer, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  corpus = tmp_path / "corpus.txt"
  _corpus(corpus, 20)
  cache_dir = caches.tokenized_cache_dir(_cache_config(tokenized=False))
  assert cache_dir is None
  _batches(corpus, tokenizer, cache_dir)
  assert not (tmp_path / "xdg").exists()
  assert sorted(os.listdir(tmp_path)) == ["corpus.txt"]


def _compile_counter():
  events = []
  def listener(event, start, end, fun_name="", **_):
    if event == timeline.COMPILE_EVENTS[-1]:
      events.append(fun_name)
  return events, listener


def test_dev_selection_compiles_once_per_run(tiny_real_dir, senteval_dir):
  """Repeated dev evaluations reuse the programs of the first (one per bucket shape)."""
  from micse_jax.encoder import SentenceEncoder
  from micse_jax.evaluation.evaluators.dev_selection import DevSelection
  base = SentenceEncoder.from_pretrained(tiny_real_dir)
  encoder = SentenceEncoder(base.model, None, base.tokenizer, model_dir=tiny_real_dir)
  eval_config = ml_collections.ConfigDict({"senteval_dir": senteval_dir, "batch_size": 256, "sickr_dev": False,
                                           "final_tasks": ""})
  selection = DevSelection(encoder, eval_config, eval_every=1)
  head = encoder.head.init(jax.random.PRNGKey(0), np.zeros((1, encoder.hidden_size), np.float32))["params"]
  params = {"encoder": base.params, "head": head}
  shapes = {batch["input_ids"].shape for split in selection.splits.values() for _, batch in split.plan.batches}
  params2 = jax.block_until_ready(jax.tree.map(lambda x: x * 1.01, params))
  events, listener = _compile_counter()
  jax.monitoring.register_event_time_span_listener(listener)
  try:
    first = selection(params)
    compiled_first = len(events)
    second = selection(params2)
    third = selection(params)
  finally:
    jax.monitoring.unregister_event_time_span_listener(listener)
  assert 1 <= compiled_first <= len(shapes) + 2  # the programs of the bucket shapes (+ tiny helpers)
  assert len(events) == compiled_first  # no compile in the second or third evaluation
  assert third == first and second != first


def _train_command(config, workdir):
  overrides = {"model.name_or_path": config.model.name_or_path, "data.corpus": config.data.corpus,
               "batch_size": 8, "num_train_steps": 3, "checkpoint_every": 3, "log_every": 1,
               "eval_every": 0, "eval.final_tasks": "", "model.max_length": 16,
               "momentum.queue_size": 12, "ami.layers": "(0,1)", "ami.num_samples": 20,
               "optim.warmup_steps": 1, "data.prefetch": 0}
  return [sys.executable, "-m", "micse_jax.main", "--config", "micse",
          "--workdir", str(workdir), *[f"--config.{k}={v}" for k, v in overrides.items()]]


@pytest.mark.slow
def test_second_run_compiles_from_the_cache(tmp_path, minilm_dir):
  """Issue 27's bar: a second run of the same shapes, with a fresh XDG_CACHE_HOME for the pair,
  spends <= 25 % of the first run's compile_s; both write timeline.json; the corpus is cached."""
  config = tiny_training_config(tmp_path, minilm_dir)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  documents = []
  for name in ("cold", "warm"):
    done = subprocess.run(_train_command(config, tmp_path / name), env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    document = jsonio.read_json(str(tmp_path / name / workdir_lib.TIMELINE_FILE))
    assert "timeline:" in done.stdout and f"compile {document['compile_s']:.1f} s" in done.stdout
    documents.append(document)
  cold, warm = documents
  for document in documents:
    assert set(timeline.KEYS) <= set(document) and document["num_sessions"] == 1
    assert document["sessions"][0]["steps"] == {"from": 0, "to": 3} and document["sessions"][0]["finished"]
  assert cold["compile_s"] > 0 and warm["compile_s"] <= 0.25 * cold["compile_s"], (cold, warm)
  root = tmp_path / "xdg" / "micse_jax"
  assert len(os.listdir(root / "tokenized")) == 1
  assert any(name.endswith("-cache") for name in os.listdir(root / "jax_compilation_cache"))



@pytest.mark.slow
def test_resume_adds_a_session_to_the_timeline(tmp_path, minilm_dir, monkeypatch):
  """A preempted run records its session (unfinished); the resume adds one; the top level sums them."""
  from micse_jax.training import checkpoint, trainer
  from tests.train_utils import train_preempted_after_first_save
  config = tiny_training_config(tmp_path, minilm_dir)
  workdir = str(tmp_path / "run")
  train_preempted_after_first_save(trainer, checkpoint, monkeypatch, config, workdir)
  trainer.train_and_evaluate(config, workdir)
  document = jsonio.read_json(os.path.join(workdir, workdir_lib.TIMELINE_FILE))
  first, second = document["sessions"]
  assert (first["finished"], first["steps"]) == (False, {"from": 0, "to": 0})
  assert (second["finished"], second["steps"]) == (True, {"from": 2, "to": 4})
  for key in timeline.KEYS:
    assert document[key] == pytest.approx(first[key] + second[key], abs=2e-3)
  assert first["compile_s"] > 0 and second["load_s"] > 0 and second["train_s"] > 0
  assert second["compilation_cache"] == caches.compilation_cache_dir(config)
