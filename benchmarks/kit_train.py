"""The kit's `train` step: the real trainer in a process of its own, and what it says about its steps.

    python -m micse_jax.main --config configs/micse.py --workdir W --config.model.name_or_path=<the kit's
        random BERT-base> --config.data.corpus=<shared data>/corpus/wiki1m_head.txt
        --config.num_train_steps=1500 --config.eval_every=125 --config.checkpoint_every=250 ...

The corpus, the SentEval folder and the held-out sentences are found as the trainer finds them
(`micse_jax/paths.py`: `$MICSE_DATA_DIR`, which `scripts/device/kit.sh` points at the kit's copy
on the lent machine, else `shared/data` above the checkout). The final evaluation is left out (the
step is about the loop: its steps, evaluations and saves), the compilation cache is a fresh
folder (the compile is a cold one), the attention follows the kit's gate (`model.attention=explicit`
when it did not prove the kernels) and `kit_plan.TRAIN_OVERRIDES` adds fields of the plan's own.

Read back from the workdir: `timeline.json` (seconds per phase, compiles, each save's blocking
seconds where the trainer records them, `SAVE_KEYS`) and the TensorBoard scalar `train/steps_per_sec`
(steps over the seconds since the previous log): the steady step is the median of those intervals
after the first evaluation (compile and warm-up before it), leaving out every interval an
evaluation or a save fell into. The report sets it beside the `b50` point (`kit_report`).
"""
from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import time

from benchmarks import kit_gate, kit_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "configs", "micse.py")
CORPUS = "wiki1m_head.txt"
SCHEDULE = {"num_train_steps": 1500, "eval_every": 125, "checkpoint_every": 250, "log_every": 10}
DRY_SCHEDULE = {"num_train_steps": 40, "eval_every": 10, "checkpoint_every": 20, "log_every": 5}
DRY_FIELDS = {"ami.layers": "(-2, -1)"}  # the tiny model's two layers (miCSE's four top layers need four)
OVERRUN_S = 60  # past the command's budget before the run is cut: the device command's own margin
SAVE_KEYS = ("saves", "save_stalls", "checkpoint_saves")  # where a timeline may record each save's stall
STEPS_PER_SEC = "train/steps_per_sec"


def trainer_args(model_dir: str, workdir: str, cache_dir: str, dry: bool, explicit: bool) -> list[str]:
  """The trainer's command line (see the module docstring)."""
  from micse_jax import paths
  fields = {"model.name_or_path": model_dir, "data.corpus": paths.corpus_path(CORPUS),
            **(dict(DRY_SCHEDULE, **DRY_FIELDS) if dry else SCHEDULE), "eval.final_tasks": "", "cache.dir": cache_dir,
            **({"model.attention": "explicit"} if explicit else {}), **kit_plan.TRAIN_OVERRIDES}
  return [sys.executable, "-m", "micse_jax.main", "--config", CONFIG, "--workdir", workdir,
          *(f"--config.{k}={v}" for k, v in fields.items())]


def train(state: str, model_dir: str, dry: bool, explicit: bool, timeout_s: float) -> dict:
  """Runs the trainer (cut at `timeout_s`) and reads its workdir; `passed` when it exited 0."""
  folder = os.path.join(state, "train")
  shutil.rmtree(folder, ignore_errors=True)  # a fresh run: a workdir left by a failed one would resume
  workdir, log = os.path.join(folder, "workdir"), os.path.join(folder, "trainer.log")
  os.makedirs(folder)
  command = trainer_args(model_dir, workdir, os.path.join(folder, "cache"), dry, explicit)
  start = time.monotonic()
  returncode = _run(command, log, timeout_s)
  with open(log, encoding="utf-8", errors="replace") as f:
    tail = f.read()[-3000:]
  schedule = DRY_SCHEDULE if dry else SCHEDULE
  result = {"command": command[3:], "returncode": returncode, "timed_out": returncode is None,
            "passed": returncode == 0, "seconds": time.monotonic() - start, "schedule": schedule,
            "attention": "explicit" if explicit else "fused", "tail": tail}
  return {**result, **read_workdir(workdir, schedule)}


def _run(command: list[str], log: str, timeout_s: float) -> int | None:
  """Exit status of `command` (output to `log`), None when cut at `timeout_s` (SIGINT, then its
  process group killed and waited for)."""
  with open(log, "w") as out:
    proc = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    return proc.wait(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGINT)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=kit_gate.KILL_GRACE_S)
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()
  kit_gate.wait_for_group_gone(proc.pid, kit_gate.KILL_GRACE_S)
  return None


def read_workdir(workdir: str, schedule: dict) -> dict:
  """The timeline, each save's stall (when recorded) and the steady step of a trainer's workdir."""
  from micse_jax import jsonio
  from micse_jax import workdir as workdir_lib
  path = os.path.join(workdir, workdir_lib.TIMELINE_FILE)
  timeline = jsonio.read_json(path) if os.path.isfile(path) else {}
  sessions = timeline.get("sessions") or [{}]
  saves = next((source[k] for source in (timeline, sessions[-1]) for k in SAVE_KEYS if k in source), None)
  sums = {k: v for k, v in timeline.items() if k != "sessions" and k not in SAVE_KEYS}
  done = sum((s.get("steps") or {}).get("to", 0) - (s.get("steps") or {}).get("from", 0) for s in sessions)
  intervals = read_scalars(os.path.join(workdir, workdir_lib.TENSORBOARD_DIR)).get(STEPS_PER_SEC, [])
  return {"timeline": sums, "saves": saves, "steps_done": done,
          "train_phase_ms_per_step": 1e3 * sums["train_s"] / done if done and "train_s" in sums else None,
          **steady_step(intervals, schedule)}


def steady_step(intervals: list[tuple[int, float]], schedule: dict) -> dict:
  """{"steady_ms_per_step", "steady_intervals", "interval_ms"} from the (log step, steps per second)
  of the trainer's log points: the median interval after the first evaluation, leaving out each
  interval an evaluation or a save fell into (its log step is the first one past it: the trainer
  logs before it evaluates or saves)."""
  n, every = schedule["num_train_steps"], schedule["eval_every"]
  logged = sorted(dict(intervals).items())
  steps = [s for s, _ in logged]
  events = [s for s in range(1, n + 1) if (every > 0 and (s % every == 0 or s == n))
            or s % schedule["checkpoint_every"] == 0 or s == n]
  polluted = {next((s for s in steps if s > e), None) for e in events}
  first_eval = min((s for s in range(1, n + 1) if every > 0 and s % every == 0), default=0)
  settled = next((s for s in steps if s > first_eval), None)  # the interval the first evaluation fell into
  kept = [1e3 / rate for s, rate in logged if settled is not None and s > settled and s not in polluted and rate > 0]
  if not kept:
    return {"steady_ms_per_step": None, "steady_intervals": 0, "interval_ms": None}
  return {"steady_ms_per_step": statistics.median(kept), "steady_intervals": len(kept),
          "interval_ms": {"min": min(kept), "max": max(kept), "mean": statistics.fmean(kept)}}


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
  """{tag: [(step, value)]} of the TensorBoard event files in `folder` (TFRecords of `Event`
  protos, scalars as `simple_value`: what tensorboardX writes); a record cut short ends its file."""
  from tensorboardX.proto import event_pb2
  found: dict[str, list[tuple[int, float]]] = {}
  for path in sorted(glob.glob(os.path.join(folder, "events.out.tfevents.*"))):
    with open(path, "rb") as f:
      while len(header := f.read(12)) == 12:
        (length,) = struct.unpack("<Q", header[:8])
        data = f.read(length)
        if len(data) < length or len(f.read(4)) < 4:
          break
        event = event_pb2.Event.FromString(data)
        for value in event.summary.value:
          if value.HasField("simple_value"):
            found.setdefault(value.tag, []).append((event.step, value.simple_value))
  return found


# ---------------------------------------------------------------- the report

RESULT_KEYS = ("returncode", "timed_out", "schedule", "attention", "command", "steady_ms_per_step", "steady_intervals",
               "interval_ms", "train_phase_ms_per_step", "steps_done", "timeline", "saves")


def train_summary(row: dict | None, b50: dict | None) -> dict | None:
  """The `train` step's figures for summary.json, with the steady step over the `b50` point's
  pipelined step and over its GPU op time per step (None where either is missing)."""
  if not row:
    return None
  result = row.get("result") or {}
  s = {"ok": row["ok"], "error": row.get("error"), "seconds": row.get("seconds"),
       **{k: result.get(k) for k in RESULT_KEYS}, "tail": None if row["ok"] else (result.get("tail") or row.get("tail"))}
  ok = b50 is not None and b50.get("ok")
  s["b50_pipelined_ms"] = b50.get("pipelined_step_ms") if ok else None
  s["b50_gpu_ms"] = (b50.get("profile") or {}).get("gpu_ms_per_step") if ok else None
  steady = s["steady_ms_per_step"]
  for key, base in (("ratio_to_bench_step", "b50_pipelined_ms"), ("ratio_to_gpu_op_time", "b50_gpu_ms")):
    s[key] = steady / s[base] if steady and s[base] else None
  return s


def _save_text(save) -> str:
  """One recorded save: "step S: X.XX s" from a mapping that names them, else as found."""
  if isinstance(save, dict):
    seconds = next((save[k] for k in ("seconds", "blocking_s", "stall_s", "s") if k in save), None)
    if seconds is not None:
      return (f"step {save['step']}: " if "step" in save else "") + f"{seconds:.2f} s"
  return f"{save:.2f} s" if isinstance(save, (int, float)) else str(save)


def train_lines(s: dict | None) -> list[str]:
  """summary.md's section on the trainer run (`train_summary`)."""
  if not s:
    return []
  schedule = s.get("schedule") or {}
  lines = ["", f"## The trainer: `python -m micse_jax.main --config configs/micse.py`, {schedule.get('num_train_steps')} "
               f"steps, evaluations every {schedule.get('eval_every')}, saves every {schedule.get('checkpoint_every')} "
               f"(model.attention {s.get('attention')})", ""]
  if not s["ok"]:
    why = s.get("error") or ("cut at its time-out" if s.get("timed_out") else f"exit {s.get('returncode')}")
    lines += [f"FAILED: {why}", ""]
  f = lambda x, fmt=".2f": "—" if x is None else format(x, fmt)
  spread = s.get("interval_ms") or {}
  lines += [f"Steady step **{f(s.get('steady_ms_per_step'))} ms** (median of {s.get('steady_intervals')} log intervals "
            f"after the first evaluation, none holding an evaluation or a save; {f(spread.get('min'))} to "
            f"{f(spread.get('max'))} ms); the train phase {f(s.get('train_phase_ms_per_step'))} ms per step (the "
            f"timeline's train seconds over {s.get('steps_done')} steps). Against b50: {f(s.get('ratio_to_bench_step'))}x "
            f"its pipelined step ({f(s.get('b50_pipelined_ms'))} ms), {f(s.get('ratio_to_gpu_op_time'))}x its GPU op "
            f"time per step ({f(s.get('b50_gpu_ms'))} ms).", ""]
  timeline = s.get("timeline") or {}
  lines += ["| " + " | ".join(k.removesuffix("_s") for k in timeline if k.endswith("_s")) + " | compiles |",
            "|" + "---|" * (sum(k.endswith("_s") for k in timeline) + 1),
            "| " + " | ".join(f(v, ".1f") for k, v in timeline.items() if k.endswith("_s"))
            + f" | {timeline.get('compiles', '—')} |", ""]
  saves = s.get("saves")
  lines.append("Each save's stall: " + (", ".join(_save_text(x) for x in saves) if saves
                                        else "not recorded by this trainer (its timeline names no saves)") + ".")
  if s.get("tail"):
    lines += ["", "```", s["tail"][-1500:], "```"]
  return lines
