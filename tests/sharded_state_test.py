"""Sharded train state (FSDP / ZeRO-3, `mesh.shard_state`): the per-leaf placement rule, which layout
an unset field chooses, the sharded run equal to the replicated one on 4 devices, and its
checkpoints resumed and exported on 1 device."""
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from micse_jax.training.data_parallel import DATA_AXIS
from micse_jax.training.state_placement import is_table, leaf_partition, shards_state
from tests.helpers import run_device_worker
from tests.portable_checkpoint_test import drop_steps_after
from tests.train_utils import tiny_training_config

ATOL = 1e-5  # sharded vs replicated after 6 steps: float32 reduction order only
MIN_ELEMENTS = 1024  # the tiny model's leaves are small: shard every matrix (biases stay replicated)


def run_config(tmp_path, tokenizer_dir, shard_state: bool):
  """The tiny miCSE run: 6 steps, checkpoints at 3 and 6, batch 8 over 4 devices."""
  return tiny_training_config(tmp_path, tokenizer_dir, num_train_steps=6, checkpoint_every=3,
                              **{"mesh.shard_state": shard_state, "mesh.shard_min_elements": MIN_ELEMENTS})


@pytest.mark.parametrize("shape, devices, table, expected", [
    ((30522, 64), 4, False, P(None, DATA_AXIS)),  # vocab not divisible by 4: the hidden dimension
    ((30520, 768), 8, False, P(DATA_AXIS)),       # the first divisible dimension
    ((768, 3072), 4, False, P(DATA_AXIS)),        # not the largest: rows stay contiguous
    ((3072, 768), 4, False, P(DATA_AXIS)),
    ((100, 3072), 8, False, P(None, DATA_AXIS)),  # 100 rows do not divide by 8
    ((256, 256), 4, False, P(DATA_AXIS)),
    ((128, 64), 4, False, P()),                   # 8192 elements: small, replicated
    ((3, 5461), 4, False, P()),                   # nothing divisible
    ((32768,), 4, False, P(DATA_AXIS)),
    ((32768,), 1, False, P()),                    # one device: nothing to split
    ((), 4, False, P()),
    ((30522, 768), 2, True, P(None, DATA_AXIS)),  # a table by its features, though its rows divide
    ((512, 768), 8, True, P(None, DATA_AXIS)),
    ((30522, 770), 4, True, P()),                 # neither divides
    ((30520, 770), 4, True, P(DATA_AXIS)),        # features do not divide: its rows
])
def test_leaf_partition(shape, devices, table, expected):
  assert leaf_partition(shape, devices, table=table) == expected  # default threshold 2**14 elements
  assert leaf_partition((64, 32), 4, min_elements=1024) == P(DATA_AXIS)


def test_tables_and_their_moments_are_found_by_their_key_path():
  tree = {"params": {"word_embeddings": {"embedding": 1}, "dense": {"kernel": 2, "bias": 3}},
          "mu": {"embeddings": {"position_embeddings": {"embedding": 4}}}, "queue": 5}
  tables = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if is_table(path)]
  assert sorted(tables) == [1, 4]
  assert not is_table(())  # a bare array (the queue's embeddings)


@pytest.mark.parametrize("field, devices, platform, members, shard_update, expected", [
    (None, 8, "cuda", 0, False, True),     # one run over several GPUs: sharded
    (None, 4, "cuda", 0, False, True),
    (None, 2, "cuda", 0, False, True),     # two GPUs: sharded too
    (None, 1, "cuda", 0, False, False),    # one GPU: nothing to split
    (None, 8, "cuda", 8, False, False),    # a population keeps each member's state whole
    (None, 8, "cuda", 0, True, False),     # ZeRO-1/2 asked for instead
    (None, 4, "cpu", 0, False, False),     # CPU and TPU: replicated
    (None, 8, "tpu", 0, False, False),
    (True, 4, "cpu", 0, False, True),      # a value given is kept
    (False, 8, "cuda", 0, False, False),
])
def test_an_unset_shard_state_is_chosen_for_the_devices(field, devices, platform, members, shard_update, expected):
  mesh_config = {"shard_state": field, "shard_update": shard_update}
  assert shards_state(mesh_config, devices, platform, members) is expected


def test_the_program_decides_the_layout_on_a_copy_of_the_config():
  from types import SimpleNamespace

  from micse_jax.configs import micse
  from micse_jax.kernels.choice import Target
  from micse_jax.training.program import _with_state_layout
  config = micse.get_config()
  assert config.mesh.shard_state is None  # the default: chosen by the devices
  gpus = Target(platform="cuda", compute_capability=(9, 0), devices=8)
  chosen = _with_state_layout(config, SimpleNamespace(size=8), gpus, 0)
  assert chosen.mesh.shard_state is True and config.mesh.shard_state is None
  assert _with_state_layout(config, SimpleNamespace(size=8), Target(devices=8), 0).mesh.shard_state is False
  config.mesh.shard_state = False
  assert _with_state_layout(config, SimpleNamespace(size=8), gpus, 0) is config


KERNEL_GRAPHS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL"}  # cuBLAS / cuDNN calls between graphs


@pytest.mark.parametrize("sharded, platform, devices, expected", [
    (True, "cuda", 8, {**KERNEL_GRAPHS, "xla_gpu_reduce_scatter_combine_threshold_bytes": 8 * 2 ** 20}),
    (True, "cuda", 16, {**KERNEL_GRAPHS, "xla_gpu_reduce_scatter_combine_threshold_bytes": 4 * 2 ** 20}),  # 64 MiB
    (True, "cuda", 2, {**KERNEL_GRAPHS, "xla_gpu_reduce_scatter_combine_threshold_bytes": 32 * 2 ** 20}),
    (False, "cuda", 8, KERNEL_GRAPHS),  # replicated: all-reduces, whose combining XLA's defaults already overlap
    (False, "cuda", 1, KERNEL_GRAPHS),
    (True, "cpu", 4, {}),
    (True, "tpu", 8, {}),
])
def test_the_step_on_gpus_keeps_library_calls_out_of_its_graphs_and_combines_reduce_scatters_in_pieces(
    sharded, platform, devices, expected):
  from micse_jax.training.xla_options import compiler_options
  assert compiler_options(sharded, platform, devices) == expected
  xla = compiler_options(sharded, platform, devices, cuda_graphs="xla")  # XLA's own default graphs
  assert xla == {k: v for k, v in expected.items() if k not in KERNEL_GRAPHS}
  if platform == "cuda":  # fixed: XLA's graphs, never updated; none: no graphs at all
    assert compiler_options(sharded, platform, devices, cuda_graphs="fixed") == dict(
        xla, xla_gpu_command_buffer_update_mode="NEVER_UPDATE")
    assert compiler_options(sharded, platform, devices, cuda_graphs="none") == dict(
        xla, xla_gpu_enable_command_buffer="")


@pytest.mark.parametrize("mode, ampere_or_newer, resolved", [
    ("auto", True, "kernels"), ("auto", False, "xla"), ("kernels", False, "kernels"), ("xla", True, "xla")])
def test_auto_keeps_library_calls_out_of_the_graphs_of_ampere_or_newer_gpus(mode, ampere_or_newer, resolved):
  from micse_jax.training.xla_options import cuda_graphs_for
  assert cuda_graphs_for(mode, ampere_or_newer) == resolved


def test_the_config_accepts_each_cuda_graphs_mode_and_auto_only():
  from micse_jax import config_checks
  from micse_jax.training.xla_options import CUDA_GRAPHS
  rule = config_checks.RULES["mesh.cuda_graphs"]
  assert all(rule(mode) is None for mode in ("auto", *CUDA_GRAPHS))
  assert rule("graphs") is not None and rule(None) is not None


def test_the_program_compiles_its_step_with_its_options():
  """`program.compiled` hands the program's `compiler_options` (its layout's, its target's, its CUDA
  graphs') to XLA."""
  import dataclasses
  from types import SimpleNamespace

  from micse_jax.configs import micse
  from micse_jax.kernels.choice import Target
  from micse_jax.training import program
  seen = []
  lowered = SimpleNamespace(compile=lambda options=None: seen.append(options) or "executable")
  config = micse.get_config()
  config.mesh.shard_state = True
  fields = {f.name: None for f in dataclasses.fields(program.Program)}

  def compiled_for(compute_capability=None):
    target = Target(platform="cuda", devices=8, compute_capability=compute_capability)
    prog = program.Program(**dict(fields, config=config, target=target))
    object.__setattr__(prog, "lower", lambda: lowered)  # no state or batch to lower: the compile call is what is read
    return program.compiled(prog).executable
  combine = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 8 * 2 ** 20}
  assert compiled_for() == "executable" and seen == [combine]  # no compute capability known: XLA's graphs
  compiled_for((9, 0))  # "auto" keeps library calls out of an H100's graphs
  assert seen[-1] == {**KERNEL_GRAPHS, **combine}
  compiled_for((7, 0))
  assert seen[-1] == combine
  config.mesh.cuda_graphs = "kernels"
  compiled_for((7, 0))
  assert seen[-1] == {**KERNEL_GRAPHS, **combine}


def _local_shape(name, shape, devices=4):
  """Independent statement of the rule: the first dimension divisible by the device count, an
  embedding table's last one first."""
  if int(np.prod(shape)) < MIN_ELEMENTS:
    return list(shape)
  dims = list(range(len(shape)))
  if name.endswith("['embedding']"):
    dims = dims[::-1]
  divisible = [d for d in dims if shape[d] % devices == 0]
  if not divisible:
    return list(shape)
  return [n // devices if i == divisible[0] else n for i, n in enumerate(shape)]


def _close(a: dict, b: dict, atol: float) -> float:
  assert sorted(a) == sorted(b) and a
  worst = 0.0
  for name in a:
    x, y = a[name], b[name]
    if np.issubdtype(x.dtype, np.floating):
      worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y))))
    else:
      np.testing.assert_array_equal(x, y, err_msg=name)
  assert worst <= atol, worst
  return worst


@pytest.fixture(scope="module")
def four_device_runs(tmp_path_factory, minilm_dir):
  tmp = tmp_path_factory.mktemp("sharded")
  report = run_device_worker("tests.sharded_state_worker", tmp, minilm_dir)
  assert report["num_devices"] == 4
  return tmp, report["layout"]


@pytest.mark.slow  # 4-device subprocess runs (about 2 min on 2 cores); the suite must stay under 15 min
def test_sharded_state_equals_replicated_on_four_devices(four_device_runs):
  tmp, layout = four_device_runs
  replicated, sharded = np.load(tmp / "replicated_4dev.npz"), np.load(tmp / "sharded_4dev.npz")
  print("sharded vs replicated, 6 steps, max abs diff:",
        _close(dict(replicated.items()), dict(sharded.items()), ATOL))
  for name, (shape, local) in layout.items():
    assert local == _local_shape(name, shape), name
  word = ".params['encoder']['embeddings']['word_embeddings']['embedding']"
  assert layout[word][1][1] * 4 == layout[word][0][1]  # the embedding matrix really is split
  split = [name for name, (s, l) in layout.items() if s != l]
  # every matrix of params and EMA params (2 layers x 6 + embeddings + head + pooler), and Adam's mu
  # and nu per leaf, each split as its parameter
  assert len(split) >= 4 * 14, split
  for name in [n for n in split if n.startswith(".params")]:
    for moment in ("mu", "nu"):
      (twin,) = [n for n in layout if n.startswith(".opt_state") and n.endswith(f".{moment}{name[len('.params'):]}")]
      assert layout[twin] == layout[name], twin
  queue = ".queue.embeddings"  # [12, 64]: 768 elements, replicated (the `Queue` struct's field)
  assert layout[queue][0] == layout[queue][1]


@pytest.mark.slow
def test_sharded_checkpoint_resumes_and_exports_on_one_device(four_device_runs, tmp_path, minilm_dir):
  from micse_jax import convert
  from micse_jax.models.loading import load_pretrained
  from micse_jax.training import trainer
  from tests.sharded_state_worker import final_state, flat_state
  tmp, _ = four_device_runs
  assert jax.device_count() == 1
  config = run_config(tmp, minilm_dir, shard_state=True)
  resumed = str(tmp_path / "resumed")
  shutil.copytree(str(tmp / "sharded"), resumed)
  drop_steps_after(resumed, 3)
  trainer.train_and_evaluate(config, resumed)  # steps 4-6 on 1 device
  state = final_state(config, resumed)
  reference = dict(np.load(tmp / "sharded_4dev.npz").items())
  print("4->1 sharded resume vs 4-device run, max abs diff:", _close(flat_state(state), reference, ATOL))
  exported = convert.convert(workdir=str(tmp / "sharded"), output=str(tmp_path / "export"))
  params = {".params" + jax.tree_util.keystr(k): np.asarray(v) for k, v in
            jax.tree_util.tree_leaves_with_path({"encoder": load_pretrained(exported)[1]})}
  shared = [k for k in reference if k.startswith(".params['encoder']") and "pooler" not in k]
  assert len(shared) > 10
  for k in shared:
    np.testing.assert_allclose(params[k], reference[k], rtol=0, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("shard_state", [True, False, None])
def test_the_models_look_tables_up_split_only_where_the_state_splits_them(shard_state):
  """`networks.model_options`: a sharded state (`mesh.shard_state`, decided before the networks are
  built) gives the model `Policy.split_tables`, so its lookups take the tables as the state holds
  them; replicated (or undecided), whole tables and no mesh for the lookups."""
  from types import SimpleNamespace

  from micse_jax.configs import micse
  from micse_jax.kernels.choice import Target
  from micse_jax.training.networks import model_options
  config = micse.get_config()
  config.mesh.shard_state = shard_state
  mesh = SimpleNamespace(size=4)
  policy = model_options(config, Target(platform="cuda", compute_capability=(9, 0), devices=4, mesh=mesh))["policy"]
  assert policy.split_tables is bool(shard_state)
  assert policy.table_mesh is (mesh if shard_state else None)
  assert policy.mesh is mesh  # the kernels' rows are split either way
