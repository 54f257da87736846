"""Issue 11, few-shot regime: corpus sentence ids travel with the batches into the momentum queue,
and the anchor's own sentence is masked out of its queue negatives (`momentum.mask_same_sentence`).

Values are checked against the arithmetic of the batch schedule (NumPy over `global_sentence_ids`)
and hand-counted cases, not against captured outputs."""
import logging

import numpy as np
import pytest

from micse_jax.data import build_train_batches, first_occurrence_ids, subset_indices
from micse_jax.tokenization import Tokenizer
from micse_jax.training import run_inputs, trainer
from micse_jax.training.momentum import self_collision_warning
from tests.train_utils import tiny_training_config


def test_first_occurrence_ids_map_duplicates_to_their_first_index():
  ids = first_occurrence_ids(["a", "b", "a", "c", "b", "a", "A"])
  np.testing.assert_array_equal(ids, [0, 1, 0, 3, 1, 0, 6])
  assert ids.dtype == np.int32


def test_batches_carry_global_corpus_ids_per_host(tmp_path, minilm_dir):
  lines = [f"line {i % 3}" if i % 4 == 0 else f"unique line {i}" for i in range(40)]  # repeats
  corpus = tmp_path / "dup.txt"
  corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
  tokenizer = Tokenizer.from_pretrained(minilm_dir)
  hosts = [build_train_batches(str(corpus), tokenizer, max_length=8, global_batch_size=8, seed=3,
                               num_sentences=24, subset_seed=5, process_index=p, process_count=2,
                               show_progress=False) for p in range(2)]
  subset = subset_indices(len(lines), 24, seed=5)
  for step in range(7):
    positions = hosts[0].global_indices(step)           # positions in the subset
    want = [lines.index(lines[subset[i]]) for i in positions]  # first occurrence of the text
    np.testing.assert_array_equal(hosts[0].global_sentence_ids(step), want)
    joined = np.concatenate([h.batch(step)["sentence_ids"] for h in hosts])
    np.testing.assert_array_equal(joined, want)
    assert joined.dtype == np.int32
  all_ids = np.concatenate([hosts[0].global_sentence_ids(s) for s in range(3)])
  assert len(set(all_ids.tolist())) < len(all_ids)  # the subset does contain duplicate texts


def test_warning_names_n_b_q_and_the_switch():
  assert self_collision_warning(448, 64, 384, True) is None  # n = Q + B: collisions are rare
  line = self_collision_warning(64, 64, 384, True)
  assert "n=64" in line and "B=64" in line and "Q=384" in line and "about 6 times" in line
  assert "mask_same_sentence=True" in line and "\n" not in line
  assert "mask_same_sentence=False" in self_collision_warning(447, 64, 384, False)


def _expected_queue_fractions(batches, steps, batch, queue):
  """Per step: (empty fraction, self fraction) of the B x Q (anchor, slot) pairs, from the schedule."""
  out = []
  for t in range(steps):
    held = range(max(0, t - queue // batch), t)  # the queue holds the last Q/B pushed batches
    in_queue = np.concatenate([batches.global_sentence_ids(s) for s in held]) if held else np.zeros(0)
    copies = [np.sum(in_queue == a) for a in batches.global_sentence_ids(t)]
    out.append(((queue - len(in_queue)) / queue, np.mean(copies) / queue))
  return out


@pytest.mark.parametrize("mask", [True, False])
def test_tiny_few_shot_run_masks_what_the_arithmetic_predicts(tmp_path, minilm_dir, monkeypatch, caplog, mask):
  b, n, q, steps = 8, 16, 32, 8  # n = 2B, Q = 4B: one epoch every 2 steps, the queue spans 2 epochs
  config = tiny_training_config(tmp_path, minilm_dir, "moco_simcse", num_train_steps=steps,
                                checkpoint_every=steps, batch_size=b,
                                **{"data.num_sentences": n, "momentum.queue_size": q,
                                   "momentum.mask_same_sentence": mask})
  logged = {}
  from micse_jax.training import summaries
  monkeypatch.setattr(summaries, "write_scalars", lambda writer, step, scalars: logged.update({step: scalars}))
  with caplog.at_level(logging.WARNING):
    trainer.train_and_evaluate(config, str(tmp_path / "wd"))
  warnings = [r.getMessage() for r in caplog.records if "few-shot regime" in r.getMessage()]
  assert len(warnings) == 1 and f"n={n}" in warnings[0] and f"mask_same_sentence={mask}" in warnings[0]

  batches = run_inputs.prepare(config).batches
  expected = _expected_queue_fractions(batches, steps, b, q)
  for t, (empty, self_frac) in enumerate(expected):
    got = logged[t + 1]  # the metrics of step t are logged at step t + 1 (steps done)
    assert got["queue_self_frac"] == pytest.approx(self_frac, abs=1e-7)
    assert got["queue_masked_frac"] == pytest.approx(empty + (self_frac if mask else 0.0), abs=1e-7)
  # Closed form: an anchor meets its own sentence once per earlier epoch the queue covers whole
  # (at an epoch start, steps t-4..t-1 are exactly two epochs); at odd t it also meets it in
  # step t-4 when the sentence sat in that epoch's second half: between 1 and 2 copies.
  copies = [round(e[1] * q, 6) for e in expected]
  assert copies[:5] == [0, 0, 1, 1, 2] and copies[6] == 2
  assert 1 <= copies[5] <= 2 and 1 <= copies[7] <= 2


def test_bad_sentence_ids_are_refused():
  from micse_jax.data import TrainBatches
  tokens = {k: np.zeros((6, 4), np.int32) for k in ("input_ids", "attention_mask", "token_type_ids")}
  for bad in (np.arange(5), np.array([0, 1, 2, 3, 4, -1])):
    with pytest.raises(ValueError, match="sentence_ids"):
      TrainBatches(tokens, 2, seed=0, sentence_ids=bad)
  ids = np.array([5, 5, 7, 8, 9, 10])
  ds = TrainBatches(tokens, 2, seed=0, sentence_ids=ids)
  np.testing.assert_array_equal(ds.global_sentence_ids(4), ids[ds.global_indices(4)])
