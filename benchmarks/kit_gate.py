"""The kit's `gpu_tests` step: the kernels' gate, their trial tests and the other GPU tests, three
pytest runs started together in process groups of their own and cut together at one time-out.

- the gate: `pytest -m "gpu and not trial"` on our kernels' file (`GATE_FILES`), in `GATE_WORKERS`
  xdist processes, the tests started longest first (`benchmarks/kit_pytest.py`). Its verdict alone
  decides whether the later points take the kernels: "passed", "failed" (a test failed, or the run
  ended with an error), or "not proven (time-out)" (cut by the time-out before any test failed);
- the trial tests (`-m "gpu and trial"`, kernel uses `kernels/choice.py` does not take yet: the
  kernels under remat) and the other files' GPU tests: reported, never deciding, at a lower CPU
  priority than the gate.

The gate and the trial tests compile with XLA's autotuning off (`PROOF_XLA_FLAGS`): the tests
compare our kernels with the explicit path on the same GPU, which the GEMM tiles XLA picks do not
touch, and autotuning (dozens of candidate programs timed per GEMM shape) is most of their compile
time (docs/GPU_ACCEPTANCE.md). The other files' tests compile as the trainer does.

At the time-out every run gets SIGINT (pytest then reports what ran and writes its JUnit XML),
and after `KILL_GRACE_S` its whole group SIGKILL, waited for until none of it runs, so no child
loads the machine the timed points run on. Outcomes and seconds per test come from the JUnit XML,
or from the live `-v` lines where the cut left none.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GATE_FILES = ("tests/dropout_attention_test.py",)
GATE_TIMEOUT_S = 100
KILL_GRACE_S = 5
GATE_WORKERS, TRIAL_WORKERS, OTHERS_WORKERS = 6, 2, 2
PROOF_XLA_FLAGS = "--xla_gpu_autotune_level=0"
LOW_PRIORITY = 10  # os.nice increment of the runs that decide nothing
# `-v` lines: "tests/x.py::t PASSED" (one process) or "[gw0] [ 10%] PASSED tests/x.py::t" (xdist)
_LIVE_OUTCOME = re.compile(r"^(?:(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)"
                           r"|\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|ERROR|SKIPPED) (tests/\S+::\S+))", re.MULTILINE)
VERDICTS = ("passed", "failed", "not proven (time-out)")


def gpu_test_files() -> list[str]:
  """The test files holding tests marked `gpu` (collecting only these saves the suite's imports),
  our kernels' first."""
  tests = os.path.join(REPO, "tests")
  found = sorted(os.path.join("tests", f) for f in os.listdir(tests) if f.endswith("_test.py")
                 and "pytest.mark.gpu" in open(os.path.join(tests, f), encoding="utf-8").read())
  return sorted(found, key=lambda f: f not in GATE_FILES)


def gpu_tests(timeout_s: float = GATE_TIMEOUT_S) -> dict:
  """The gate's counts, outcomes, seconds per test and `verdict` at the top level, the trial
  tests' and the other files' runs under "trial" and "others" (see the module docstring)."""
  files = gpu_test_files()
  others = [f for f in files if f not in GATE_FILES]
  gate_files = [f for f in files if f in GATE_FILES]
  proof = {"XLA_FLAGS": " ".join(filter(None, (os.environ.get("XLA_FLAGS"), PROOF_XLA_FLAGS)))}
  runs = [_start("gpu and not trial", gate_files, GATE_WORKERS, proof, 0),
          _start("gpu and trial", gate_files, TRIAL_WORKERS, proof, LOW_PRIORITY)]
  if others:
    runs.append(_start("gpu and not trial", others, OTHERS_WORKERS, {}, LOW_PRIORITY))
  gate, trial, *rest = _finish(runs, time.monotonic() + timeout_s)
  return dict(gate, trial=trial, others=rest[0] if rest else None)


def verdict(run: dict) -> str:
  """"passed", "failed" or "not proven (time-out)" of one pytest run (`VERDICTS`)."""
  if run["returncode"] == 0:
    return "passed"
  if run["timed_out"] and not run["failed_before_cut"]:
    return "not proven (time-out)"
  return "failed"


@dataclasses.dataclass
class _Run:
  """One pytest run under way: its process, output file, JUnit XML and files."""
  proc: subprocess.Popen
  output: str
  junit: str
  files: list[str]
  cut_at: int | None = None  # output bytes written when the time-out came


def _command(markers: str, files: list[str], workers: int, junit: str) -> list[str]:
  parallel = ["-n", str(workers), "-p", "benchmarks.kit_pytest"] if importlib.util.find_spec("xdist") else []
  return [sys.executable, "-m", "pytest", "-m", markers, "-v", "--tb=short", "-p", "no:cacheprovider", "-o",
          "addopts=", f"--junitxml={junit}", *parallel, *files]


def _start(markers: str, files: list[str], workers: int, env: dict, nice: int) -> _Run:
  """Starts `pytest -m MARKERS` on `files` in a process group of its own, its output to a file."""
  folder = tempfile.mkdtemp(prefix="micse_kit_pytest_")
  output, junit = os.path.join(folder, "output.txt"), os.path.join(folder, "junit.xml")

  def _child():
    # A job started in the background inherits SIGINT ignored, and Python then never raises
    # KeyboardInterrupt: the child gets SIGINT's default back so that the time-out reaches pytest.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if nice:
      os.nice(nice)
  with open(output, "w") as out:
    proc = subprocess.Popen(_command(markers, files, workers, junit), cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, **env}, start_new_session=True, preexec_fn=_child)
  return _Run(proc, output, junit, files)


def _finish(runs: list[_Run], deadline: float, grace_s: float = KILL_GRACE_S) -> list[dict]:
  """Waits for `runs` until `deadline`; cuts those still running (SIGINT, then after `grace_s` SIGKILL
  to the group, waited for until gone); returns each run's result."""
  for run in runs:
    with contextlib.suppress(subprocess.TimeoutExpired):
      run.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
  cut = [run for run in runs if run.proc.poll() is None]
  for run in cut:
    run.cut_at = os.path.getsize(run.output)
    with contextlib.suppress(ProcessLookupError):
      os.killpg(run.proc.pid, signal.SIGINT)
  for run in cut:
    with contextlib.suppress(subprocess.TimeoutExpired):
      run.proc.wait(timeout=max(0.0, deadline + grace_s - time.monotonic()))
  for run in runs:  # a cut run, or children a finished one left behind: none may load the timed points
    with contextlib.suppress(ProcessLookupError):
      os.killpg(run.proc.pid, signal.SIGKILL)
    run.proc.wait()
    wait_for_group_gone(run.proc.pid, grace_s)
  return [_result(run) for run in runs]


def _result(run: _Run) -> dict:
  """Counts, outcomes and seconds per test of a finished run (from its JUnit XML, else its live lines)."""
  with open(run.output, encoding="utf-8", errors="replace") as f:
    output = f.read()
  before_cut = output if run.cut_at is None else output[:run.cut_at]
  counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
  outcomes, seconds = live_outcomes(output), {}
  if os.path.isfile(run.junit) and os.path.getsize(run.junit):
    with contextlib.suppress(ET.ParseError):
      suite = ET.parse(run.junit).getroot()
      suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
      counts = {k: int(suite.get(k, 0)) for k in counts}
      junit_found, seconds = junit_outcomes(suite)
      outcomes.update(junit_found)
  timed_out = run.cut_at is not None
  result = {"returncode": None if timed_out else run.proc.returncode, **counts, "outcomes": outcomes,
            "seconds": seconds, "files": run.files, "passed": run.proc.returncode == 0 and not timed_out,
            "timed_out": timed_out, "tail": output[-3000:],
            "failed_before_cut": any(o in ("failed", "error") for o in live_outcomes(before_cut).values())}
  return dict(result, verdict=verdict(result))


def live_outcomes(output: str) -> dict[str, str]:
  """{test name: passed | failed | error | skipped} of pytest's `-v` lines."""
  found = {}
  for plain, plain_outcome, xdist_outcome, xdist_name in _LIVE_OUTCOME.findall(output):
    name, outcome = (plain, plain_outcome) if plain else (xdist_name, xdist_outcome)
    found[name.split("::", 1)[1]] = outcome.lower()
  return found


def junit_outcomes(suite) -> tuple[dict[str, str], dict[str, float]]:
  """({test name: passed | failed | error | skipped}, {test name: seconds}) of a JUnit XML test suite."""
  outcomes, seconds = {}, {}
  for case in suite.iter("testcase"):
    kind = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    outcomes[case.get("name")] = {"failure": "failed"}.get(kind, kind)
    seconds[case.get("name")] = round(float(case.get("time", 0) or 0), 2)
  return outcomes, seconds


def live_members(group: int) -> list[int]:
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


def wait_for_group_gone(group: int, timeout_s: float) -> None:
  """Wait until the killed group has died: SIGKILL is delivered when a process is next scheduled,
  so a loaded machine can show it running for a moment after `killpg` returns."""
  deadline = time.monotonic() + timeout_s
  while live_members(group) and time.monotonic() < deadline:
    time.sleep(0.05)
