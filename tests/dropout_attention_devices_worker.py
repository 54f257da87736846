"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/dropout_attention_test.py): a
BERT whose attention runs the dropout-attention kernels (Pallas' interpreter) under `shard_map` on a
batch-sharded 4-device mesh, against the same model on one device; prints JSON."""
import json

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from micse_jax.kernels import choice
from micse_jax.models.bert import BertModel, collect_attentions
from micse_jax.models.bert_config import BertConfig
from micse_jax.models.policy import Policy

LENGTH, ROWS = 16, 8


def run(devices, kernels: bool = True) -> tuple:
  """(hidden states, loss, gradients, compiled HLO) of a train-mode forward on `devices`, with the
  kernels (the interpreter) or on the explicit path."""
  mesh = Mesh(np.array(devices), ("data",))
  target = choice.target_of(devices, interpret=kernels, mesh=mesh)
  config = BertConfig(vocab_size=50, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=256, attention_probs_dropout_prob=0.3, hidden_dropout_prob=0.1)
  # layer 1 sown (as AMI's layers are): its kernels also return the probabilities and take their gradient
  model = BertModel(config, dtype=jnp.bfloat16, policy=Policy(target=target), sow_attention_layers=(1,))
  ids = jax.random.randint(jax.random.PRNGKey(0), (ROWS, LENGTH), 1, 50)
  mask = (jnp.arange(LENGTH)[None] < jnp.array([16, 10, 5, 16, 3, 12, 16, 7])[:, None]).astype(jnp.int32)
  params = BertModel(config).init(jax.random.PRNGKey(1), ids, mask)["params"]

  def loss(p, ids, mask):
    out, state = model.apply({"params": p}, ids, mask, deterministic=False, rngs={"dropout": jax.random.PRNGKey(3)},
                             mutable=["intermediates"])
    probs = collect_attentions(state["intermediates"], (1,))
    return jnp.sum(out.last_hidden_state.astype(jnp.float32) ** 2) + 100 * jnp.sum(jnp.square(probs)), out.last_hidden_state

  rows, shared = NamedSharding(mesh, PartitionSpec("data")), NamedSharding(mesh, PartitionSpec())
  fn = jax.jit(jax.value_and_grad(loss, has_aux=True), in_shardings=(shared, rows, rows))
  (value, hidden), grads = fn(params, ids, mask)
  return np.asarray(hidden, np.float32), float(value), jax.tree.map(np.asarray, grads), \
      fn.lower(params, ids, mask).compile().as_text()


def spread_members() -> bool:
  """A population spread one member per device (`population.make_population_step`: `vmap` over
  members under a member-split `shard_map`): each member's context is its own `reference`."""
  from micse_jax.kernels import dropout_attention as da
  mesh = Mesh(np.array(jax.devices()), ("member",))
  keys = jax.random.split(jax.random.PRNGKey(7), 4)
  projection = jnp.stack([jax.random.normal(k, (3, LENGTH, 3 * 128)) for k in keys]).astype(jnp.bfloat16)
  biases = tuple(jnp.full((4, 128), 0.1 * i) for i in range(3))
  key_mask = jnp.broadcast_to(jnp.arange(LENGTH) < 11, (4, 3, LENGTH))
  words = jnp.stack([jax.random.key_data(k) for k in keys])
  member = lambda p, m, w, *b: da.dropout_attention(p, b, m, w, 0.3, 2, interpret=True)
  spread = jax.shard_map(jax.vmap(member), mesh=mesh, in_specs=PartitionSpec("member"),
                         out_specs=PartitionSpec("member"), check_vma=False)
  got = jax.jit(spread)(projection, key_mask, words, *biases)
  want = [da.reference(projection[m], tuple(b[m] for b in biases), key_mask[m], words[m], 0.3, 2) for m in range(4)]
  return all(np.array_equal(np.asarray(got[m]), np.asarray(want[m])) for m in range(4))


def main():
  assert jax.device_count() == 4, jax.devices()
  hidden1, loss1, grads1, _ = run(jax.devices()[:1])
  hidden4, loss4, grads4, text = run(jax.devices())
  plain1, _, _, _ = run(jax.devices()[:1], kernels=False)
  plain4, _, plain_grads4, _ = run(jax.devices(), kernels=False)
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(grads1))
  worst = lambda got, want: max(float(np.max(np.abs(a - b) / (np.abs(b) + 2 ** -9 * scale)))
                                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  print(json.dumps({
      "hidden_diff": float(np.max(np.abs(hidden4 - hidden1))), "plain_hidden_diff": float(np.max(np.abs(plain4 - plain1))),
      "hidden_vs_plain": float(np.max(np.abs(hidden4 - plain4))), "loss_rel": abs(loss4 - loss1) / abs(loss1),
      "grad_worst": worst(grads4, grads1), "plain_grad_worst": worst(plain_grads4, grads1),
      "all_gathers": text.count("all-gather-start") + text.count(" all-gather("), "spread_members": spread_members()}))


if __name__ == "__main__":
  main()
