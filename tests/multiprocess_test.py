"""Multi-host path on localhost: 2 processes × 2 CPU devices (jax.distributed + gloo) train
the same global batches as one process and end in the same state; the multi-process workdir
then converts in one process and resumes in one process (portable checkpoints)."""
import os
import shutil
import subprocess

import jax
import numpy as np
import pytest

from micse_jax import convert
from micse_jax import workdir as workdir_lib
from micse_jax.data import subset_indices
from micse_jax.models import weights
from micse_jax.models.loading import load_hf_state_dict
from micse_jax.training import checkpoint, trainer
from tests.helpers import fake_devices_env
from tests.portable_checkpoint_test import EXPORT_ATOL, RESUME_ATOL, drop_steps_after
from tests.train_utils import step0_shapes, tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _restore(workdir, config):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # restore onto this topology
  return checkpoint.restore_state(workdir_lib.rolling_manager(workdir, 2), step0_shapes(config, device))


def _assert_close(a, b, atol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=0, atol=atol)


def _train_in_two_processes(config, workdir: str) -> None:
  """Trains the tiny test `config` with launch/local_multiprocess.sh: 2 processes x 2 devices."""
  fields = {"model.name_or_path": config.model.name_or_path, "data.corpus": config.data.corpus,
            "batch_size": config.batch_size, "num_train_steps": config.num_train_steps,
            "checkpoint_every": config.checkpoint_every, "eval_every": 0, "eval.final_tasks": "",
            "model.max_length": config.model.max_length, "momentum.queue_size": config.momentum.queue_size,
            "ami.layers": "(" + ",".join(str(i) for i in config.ami.layers) + ")",
            "ami.num_samples": config.ami.num_samples, "optim.warmup_steps": config.optim.warmup_steps,
            "optim.learning_rate": config.optim.learning_rate, "data.num_sentences": config.data.num_sentences}
  env = fake_devices_env(2)
  out = subprocess.run(["bash", "launch/local_multiprocess.sh", "2", "--config", "configs/micse.py",
                        "--workdir", workdir, *(f"--config.{k}={v}" for k, v in fields.items())],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow  # 40 s of the default run (CI budget); tests/train_test.py's 4-device run stays
def test_two_processes_match_one_process_then_convert_and_resume_in_one(tmp_path, minilm_dir):
  # n = B = 8: from step 1 every anchor meets its own sentence in the queue, so the hosts' rows
  # of global corpus ids and the same-sentence mask are part of what must match.
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=4, checkpoint_every=2,
                                **{"data.num_sentences": 8})
  multi = str(tmp_path / "multi")
  _train_in_two_processes(config, multi)
  single = str(tmp_path / "single")
  trainer.train_and_evaluate(config, single)
  a, b = _restore(single, config), _restore(multi, config)
  assert int(a.step) == int(b.step) == 4
  _assert_close(a, b, RESUME_ATOL)  # reduction order across 4 devices vs 1
  ids = np.asarray(b.queue.ids)  # 4 pushes of 8 into 12 slots; each batch is the whole subset
  assert len(ids) == 12 and set(ids.tolist()) == set(subset_indices(96, 8, seed=0).tolist())

  # convert in one process: exactly the params the 2-process run saved
  assert jax.process_count() == 1 and jax.device_count() == 1
  exported = load_hf_state_dict(convert.convert(workdir=multi, output=str(tmp_path / "export")))
  expected = weights.flax_params_to_hf_state_dict(jax.device_get(b.params["encoder"]))
  shared = [n for n in expected if not n.startswith("pooler.")]
  assert len(shared) > 10
  for name in shared:
    np.testing.assert_allclose(exported[name], expected[name], rtol=0, atol=EXPORT_ATOL, err_msg=name)

  # resume in one process: the 2-process run cut back to step 2, finished here
  resumed = str(tmp_path / "resumed")
  shutil.copytree(multi, resumed)
  drop_steps_after(resumed, 2)
  trainer.train_and_evaluate(config, resumed)
  c = _restore(resumed, config)
  assert int(c.step) == 4
  _assert_close(c, b, RESUME_ATOL)
  _assert_close(c, a, RESUME_ATOL)


@pytest.mark.slow  # like the even split above (CI budget)
def test_two_processes_with_an_odd_split_match_one_process(tmp_path, minilm_dir):
  # Global batch 7 on 2 processes x 2 devices: padded to 8 rows, host 0 holds 4 real rows, host 1
  # holds 3 real rows and 1 padding row (no anchor, no negative, never enqueued). The run must
  # be the one-device run of the unpadded batch of 7.
  config = tiny_training_config(tmp_path, minilm_dir, num_train_steps=3, checkpoint_every=3,
                                **{"data.num_sentences": 8, "batch_size": 7})
  multi = str(tmp_path / "multi")
  _train_in_two_processes(config, multi)
  single = str(tmp_path / "single")
  trainer.train_and_evaluate(config, single)
  a, b = _restore(single, config), _restore(multi, config)
  assert int(a.step) == int(b.step) == 3
  _assert_close(a, b, RESUME_ATOL)  # reduction order across 4 devices vs 1
  ids = np.asarray(b.queue.ids)  # 3 pushes of 7 real rows into 12 slots, no padding row
  assert int(b.queue.ptr) == (3 * 7) % 12 and np.all(ids >= 0)
  np.testing.assert_array_equal(ids, np.asarray(a.queue.ids))
