"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4 (see
portable_checkpoint_test.py): trains a workdir on 4 devices, keeps a best checkpoint from the
4-device params, exports it on this topology, and resumes a 1-device run on 4 devices."""
import json
import pathlib
import shutil
import sys

import jax
import numpy as np


def state_on_this_topology(config, workdir):
  """The latest TrainState, replicated over this process's 4-device mesh (the trainer's target)."""
  from micse_jax import workdir as workdir_lib
  from micse_jax.training import checkpoint, data_parallel
  from tests.train_utils import step0_shapes
  abstract = step0_shapes(config, data_parallel.replicated(data_parallel.data_mesh()))
  return checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), abstract)


def main(tmp, tokenizer_dir, one_device_workdir):
  from micse_jax import convert
  from micse_jax import workdir as workdir_lib
  from micse_jax.training import checkpoint, trainer
  from tests.portable_checkpoint_test import drop_steps_after, steps_config
  assert jax.device_count() == 4, jax.devices()
  tmp = pathlib.Path(tmp)
  config = steps_config(tmp, tokenizer_dir)
  w4 = str(tmp / "w4")
  trainer.train_and_evaluate(config, w4)
  state = state_on_this_topology(config, w4)
  assert state.params["head"]["dense"]["kernel"].sharding.num_devices == 4
  checkpoint.save_best(workdir_lib.best_manager(w4), int(state.step), state.params, 0.5)
  flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(jax.device_get(state.params))}
  np.savez(tmp / "w4_params.npz", **flat)
  convert.convert(workdir=w4, output=str(tmp / "export_on_4"))
  # 1 → 4: the 1-device run, cut back to its step-3 checkpoint, resumed here on 4 devices.
  r14 = str(tmp / "r14")
  shutil.copytree(one_device_workdir, r14)
  drop_steps_after(r14, 3)
  trainer.train_and_evaluate(config, r14)
  print(json.dumps({"num_devices": jax.device_count(), "w4_step": int(state.step)}))


if __name__ == "__main__":
  main(*sys.argv[1:])
