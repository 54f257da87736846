"""Kernels of the miCSE step compiled for an H100 without one (issue 26, part 2), until `bench --aot` lands.

    JAX_PLATFORMS=cpu PYTHONPATH=<dir holding jax_cuda13_plugin + jax_cuda13_pjrt 0.10.2> \
        python scripts/update_kernels_aot.py --model bert-base --batch_size 50 --dtype bfloat16

Compiles the full train step (bench config: AMI on the last four layers, momentum + queue) for an
H100 described by the GpuTargetConfigProto below (public figures), counts the kernels of the
entry computation (fusions, custom calls, copies: everything but parameters, constants, tuples
and bitcasts) by kind and by the step's named scope (`optimizer`, `ema`, `finite`), and compiles
the update alone (optimizer + EMA + grad norm). Prints one JSON line.
"""
import argparse
import collections
import json
import re
import time

import jax
import optax
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

H100 = """gpu_device_info { threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3350000000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 85899345920
  shared_memory_per_block_optin: 232448 cuda_compute_capability { major: 9 minor: 0 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 10 patch: 0 } runtime_version { major: 13 minor: 0 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""
NOT_KERNELS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id",
               "replica-id", "opt-barrier", "add-dependency"}
SCOPES = ("optimizer", "ema", "finite")


def entry_instructions(hlo: str):
  """(opcode, line) of every instruction of the ENTRY computation of optimised HLO text."""
  lines = hlo.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  for line in lines[start + 1:]:
    if line.startswith("}"):
      return
    m = re.search(r"= (?:\([^=]*?\)|\S+) ([a-z][a-z0-9\-]*)\(", line)
    if m and m.group(1) not in NOT_KERNELS:
      yield m.group(1), line


def kernel_counts(hlo: str) -> tuple[collections.Counter, collections.Counter]:
  """(kernels by kind, kernels by named scope) of the entry computation."""
  kinds, scopes = collections.Counter(), collections.Counter()
  for op, line in entry_instructions(hlo):
    if op == "fusion":
      kind = "fusion:" + re.search(r"kind=(\w+)", line).group(1) + (":triton" if "__triton" in line else "")
    elif op == "custom-call":
      kind = "custom-call:" + re.search(r'custom_call_target="([^"]+)"', line).group(1)
    else:
      kind = op
    kinds[kind] += 1
    name = (re.search(r'op_name="([^"]*)"', line) or re.search("()", "")).group(1)
    scopes[next((s for s in SCOPES if f"/{s}/" in name or name.endswith(f"/{s}")), "other")] += 1
  return kinds, scopes


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="bert-base")
  parser.add_argument("--batch_size", type=int, default=50)
  parser.add_argument("--max_length", type=int, default=32)
  parser.add_argument("--dtype", default="bfloat16")
  args = parser.parse_args()
  from micse_jax.bench.jax_step import bench_config, model_dir_for, random_batch
  from micse_jax.models.loading import load_pretrained
  from micse_jax.training import optim, setup
  from micse_jax.training.momentum import ema_update
  from micse_jax.training.networks import build_networks
  from micse_jax.training.step import make_train_step
  device = topologies.get_topology_desc("h100", "cuda", target_config=H100, topology="1x1x1").devices[0]
  on_h100 = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=SingleDeviceSharding(device)), tree)
  model_dir = model_dir_for(args.model)
  _, encoder, bert_config, _ = load_pretrained(model_dir)
  c = bench_config(model_dir, bert_config.num_hidden_layers, args.batch_size, args.max_length, args.dtype)
  nets, tx = build_networks(c, bert_config), optim.make_optimizer(c)
  params, frozen = setup.initial_params(c, nets, encoder)
  state = jax.eval_shape(lambda: setup.new_train_state(c, bert_config.hidden_size, tx, params, frozen))
  batch = random_batch(args.batch_size, args.max_length, bert_config.vocab_size)
  t = time.perf_counter()
  step = jax.jit(make_train_step(c, nets, tx, optim.learning_rate_schedule(c)), donate_argnums=0)
  compiled = step.lower(on_h100(state), on_h100(batch)).compile()
  seconds = time.perf_counter() - t
  kinds, scopes = kernel_counts(compiled.as_text())

  def update(grads, opt_state, params, ema):
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, ema_update(params["encoder"], ema, c.momentum.decay), optim.global_grad_norm(grads)

  alone = jax.jit(update, donate_argnums=(1, 2, 3)).lower(
      *on_h100((state.params, state.opt_state, state.params, state.ema_params))).compile()
  alone_kinds, _ = kernel_counts(alone.as_text())
  print(json.dumps({"model": args.model, "batch_size": args.batch_size, "dtype": args.dtype,
                    "state_leaves": {k: len(jax.tree.leaves(getattr(state, k))) for k in
                                     ("params", "ema_params", "opt_state")},
                    "kernels_per_step": sum(kinds.values()), "by_kind": dict(kinds), "by_scope": dict(scopes),
                    "update_alone_kernels": sum(alone_kinds.values()), "update_alone_by_kind": dict(alone_kinds),
                    "compile_s": round(seconds, 1)}))


if __name__ == "__main__":
  main()
