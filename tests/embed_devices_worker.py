"""Run with XLA_FLAGS=--xla_force_host_platform_device_count=4 (tests/embed_test.py): a table split by
features over 4 devices and a batch of ids split by rows, as the sharded train state and data
parallelism give them; the split lookup (`embed.split_lookup`) and its table gradient against
NumPy, the compiled program's collectives, the `Embed` module's choice, and the FSDP gather that
leaves tables alone (`state_placement.gathered_for_compute`); prints JSON."""
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from micse_jax.kernels import choice
from micse_jax.models import embed
from micse_jax.models.policy import Policy
from micse_jax.training import data_parallel, state_placement

ROWS, FEATURES, SENTENCES, TOKENS = 1000, 32, 8, 6


def _collectives(text: str) -> list[str]:
  return sorted(set(re.findall(r"\b(all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                               r"(?:-start)?\(", text)))


def main():
  mesh = data_parallel.data_mesh()
  rng = np.random.default_rng(0)
  table_np = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
  ids_np = rng.integers(0, ROWS, size=(SENTENCES, TOKENS)).astype(np.int32)
  ids_np[:, 0] = 7  # one id in every sentence of every device: its gradient adds across devices
  weights_np = rng.normal(size=(SENTENCES, TOKENS, FEATURES)).astype(np.float32)
  by_features = NamedSharding(mesh, P(None, "data"))
  by_rows = NamedSharding(mesh, P("data"))
  table = jax.device_put(jnp.asarray(table_np), by_features)
  ids = jax.device_put(jnp.asarray(ids_np), by_rows)
  weights = jax.device_put(jnp.asarray(weights_np), by_rows)

  lookup = jax.jit(lambda t, i: embed.split_lookup(t, i, jnp.float32, mesh))
  loss = lambda t, i, w: jnp.sum(w * embed.split_lookup(t, i, jnp.float32, mesh) ** 2)
  grad = jax.jit(jax.grad(loss))
  looked_up, table_grad = lookup(table, ids), grad(table, ids, weights)
  expected_grad = np.zeros((ROWS, FEATURES))
  np.add.at(expected_grad, ids_np, 2 * weights_np.astype(np.float64) * table_np[ids_np])
  grad_text = grad.lower(table, ids, weights).compile().as_text()

  module = embed.Embed(num_embeddings=ROWS, features=FEATURES)
  small = embed.Embed(num_embeddings=8, features=FEATURES)  # 1 kB: gathered whole, as the position table is
  variables = {"params": {"embedding": table}}
  # applied as a model whose sharded state holds the tables split over the mesh applies them
  with Policy(target=choice.target_of(mesh.devices.flat, mesh=mesh), split_tables=True).applied():
    module_text = jax.jit(lambda v, i: module.apply(v, i)).lower(variables, ids).compile().as_text()
    small_text = jax.jit(lambda v, i: small.apply(v, i)).lower(
        {"params": {"embedding": jax.device_put(jnp.asarray(table_np[:8]), by_features)}}, ids % 8).compile().as_text()

  state = {"word_embeddings": {"embedding": table}, "dense": {"kernel": table}}
  gathered = jax.jit(lambda s: state_placement.gathered_for_compute(s, mesh, True))(state)
  print(json.dumps({
      "values_equal": bool(np.array_equal(np.asarray(looked_up), table_np[ids_np])),
      "output_spec": str(looked_up.sharding.spec),
      "grad_error": float(np.max(np.abs(np.asarray(table_grad, np.float64) - expected_grad))),
      "grad_scale": float(np.max(np.abs(expected_grad))),
      "grad_spec": str(table_grad.sharding.spec),
      "grad_collectives": _collectives(grad_text),
      "table_gathered_in_grad": f"f32[{ROWS},{FEATURES}]" in grad_text,
      "module_collectives": _collectives(module_text),
      "small_table_collectives": _collectives(small_text),
      "gathered_specs": {k: str(v[next(iter(v))].sharding.spec) for k, v in gathered.items()},
  }))


if __name__ == "__main__":
  main()
