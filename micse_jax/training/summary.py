"""The few lines that end a training run: best dev score, where the artefacts are, how to export."""
from __future__ import annotations

import os

import jax

from micse_jax import workdir as workdir_lib


def run_summary(workdir: str) -> list[str]:
  """Lines naming the best STS-B dev score and step, results.json, the best checkpoint,
  the TensorBoard logs and the export command (paths absolute, so they can be pasted)."""
  wd = os.path.abspath(workdir)
  lines = [f"run finished: {wd}"]
  best_dir = os.path.join(wd, workdir_lib.BEST_DIR)
  manager, best_step = None, None
  if os.path.isdir(best_dir) and any(n.isdigit() for n in os.listdir(best_dir)):
    manager = workdir_lib.best_manager(wd, read_only=True)
    best_step = manager.best_step()
  if best_step is not None:
    score = float(manager.metrics(best_step)["stsb_dev"])
    lines.append(f"  best STS-B dev:   {score:.2f} at step {best_step}")
    lines.append(f"  best checkpoint:  {os.path.join(best_dir, str(best_step))}")
  else:
    lines.append("  best STS-B dev:   none (no dev selection: eval_every=0 or no SentEval data)")
  results = os.path.join(wd, "results.json")
  lines.append(f"  results:          {results if os.path.isfile(results) else 'none (eval.final_tasks empty or no SentEval data)'}")
  lines.append(f"  TensorBoard logs: tensorboard --logdir {os.path.join(wd, 'tensorboard')}")
  which = " --best" if best_step is not None else ""
  lines.append(f"  export:           python -m micse_jax.convert --workdir {wd}{which} --output EXPORT_DIR")
  return lines


def print_run_summary(workdir: str) -> None:
  if jax.process_index() == 0:
    print("\n".join(run_summary(workdir)), flush=True)
