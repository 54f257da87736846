"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4: a population of 4
spread over the 4 devices (one member each) and one of 2 whose rows are split over the 4 devices,
against the same members trained on 1 device (which population_test checks against the solo
runs); the spread step's compiled HLO is searched for collectives."""
import json
import pathlib
import re
import sys

import jax

COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def _saved_on_one_device_restored_on_four(state, directory):
  """The population's stacked checkpoint written from one device, resumed onto the 4-device member mesh."""
  from micse_jax import workdir as workdir_lib
  from micse_jax.training import checkpoint, population_placement
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  manager = workdir_lib.rolling_manager(str(directory), 2)
  checkpoint.save_state(manager, jax.device_put(state, one))
  manager.wait_until_finished()
  mesh = population_placement.population_mesh(4)
  abstract = jax.eval_shape(lambda: state)
  sharding = population_placement.state_sharding(abstract, mesh)
  placed = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), abstract, sharding)
  return checkpoint.resume(workdir_lib.rolling_manager(str(directory), 2), placed)


def main(tmp, tokenizer_dir):
  from micse_jax.training import population, population_placement
  from tests.population_utils import compared_parts, max_difference, run_population
  from tests.train_utils import tiny_training_config
  assert jax.device_count() == 4, jax.devices()
  config = tiny_training_config(pathlib.Path(tmp), tokenizer_dir, num_train_steps=20)
  config.population.seeds = (1, 2, 3, 4)
  reference, _ = run_population(config, 20, jax.devices()[:1])
  hlo = []
  spread, _ = run_population(config, 20, jax.devices(), hlo)
  config.population.seeds = (1, 2)  # a member does not depend on the others: members 0, 1 of the reference
  split, _ = run_population(config, 20, jax.devices())
  member = lambda state, i: compared_parts(population.member(state.members, i))
  restored = _saved_on_one_device_restored_on_four(reference, pathlib.Path(tmp) / "portable")
  found = sorted({c for c in COLLECTIVES if re.search(rf"\b{c}(-start)?\(", hlo[0])})
  print(json.dumps({
      "num_devices": jax.device_count(),
      "spread": {"mesh": list(population_placement.population_mesh(4).axis_names), "collectives": found,
                 "max_diff": max(max_difference(member(spread, i), member(reference, i)) for i in range(4))},
      "restored_4dev_max_diff": max_difference(restored, reference),
      "restored_shardings": sorted({"/".join(map(str, x.sharding.spec)) for x in jax.tree.leaves(restored.members)}),
      "split": {"mesh": list(population_placement.population_mesh(2).axis_names),
                "max_diff": max(max_difference(member(split, i), member(reference, i)) for i in range(2))}}))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
