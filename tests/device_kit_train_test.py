"""The GPU kit's `train` step and its plan without a GPU (`benchmarks/kit_train.py`, `kit_plan.py`):
the trainer's command line, the steady step read from TensorBoard log intervals, the timeline and
each save's stall read from the workdir, the ratios to the b50 point in the report, a trainer cut
at its time-out, the plan's two commands within one lease, and docs/GPU_ACCEPTANCE.md's statement
of the plan."""
import json
import os
import struct
import sys
import textwrap

import pytest

from benchmarks import kit, kit_plan, kit_report, kit_train

SCHEDULE = {"num_train_steps": 100, "eval_every": 25, "checkpoint_every": 50, "log_every": 10}
# (log step, steps per second): evaluations after 25, 50, 75, 100 fall into the intervals ending at
# 30, 60, 80; saves after 50 and 100 into 60 and none; the first evaluation settles after 30.
INTERVALS = [(10, 0.2), (20, 1.0), (30, 2.0), (40, 50.0), (50, 40.0), (60, 3.0), (70, 50.0), (80, 4.0),
             (90, 25.0), (100, 50.0)]


def test_the_steady_step_is_the_median_interval_after_the_first_evaluation_without_evaluations_or_saves():
  s = kit_train.steady_step(INTERVALS, SCHEDULE)
  # kept: 40, 50, 70, 90, 100 -> 20, 25, 20, 40, 20 ms per step
  assert s == {"steady_ms_per_step": 20.0, "steady_intervals": 5,
               "interval_ms": {"min": 20.0, "max": 40.0, "mean": pytest.approx(25.0)}}
  assert kit_train.steady_step(INTERVALS[:3], SCHEDULE)["steady_ms_per_step"] is None  # nothing settled yet


def _write_scalars(folder, intervals):
  from tensorboardX import SummaryWriter
  writer = SummaryWriter(str(folder))
  for step, rate in intervals:
    writer.add_scalar("train/steps_per_sec", rate, step)
    writer.add_scalar("train/loss", 1.0 / step, step)
  writer.close()


def test_tensorboard_scalars_are_read_back_and_a_record_cut_short_ends_the_file(tmp_path):
  _write_scalars(tmp_path, INTERVALS)
  (events,) = [p for p in tmp_path.iterdir() if p.name.startswith("events.out.tfevents")]
  with open(events, "ab") as f:  # a writer killed mid-record
    f.write(struct.pack("<Q", 1000) + b"\0\0\0\0" + b"partial")
  scalars = kit_train.read_scalars(str(tmp_path))
  assert scalars["train/steps_per_sec"] == [(s, pytest.approx(r)) for s, r in INTERVALS]
  assert scalars["train/loss"][0] == (10, pytest.approx(0.1))


def _workdir(tmp_path, saves_where=None):
  workdir = tmp_path / "workdir"
  _write_scalars(workdir / "tensorboard", INTERVALS)
  saves = [{"step": 50, "seconds": 0.8}, {"step": 100, "seconds": 1.25}]
  session = {"id": "a", "compile_s": 40.0, "train_s": 2.5, "eval_s": 3.0, "save_s": 2.05, "total_s": 50.0,
             "steps": {"from": 0, "to": 100}, **({"saves": saves} if saves_where == "session" else {})}
  timeline = {"compile_s": 40.0, "train_s": 2.5, "eval_s": 3.0, "save_s": 2.05, "total_s": 50.0, "compiles": 7,
              "num_sessions": 1, "sessions": [session], **({"saves": saves} if saves_where == "top" else {})}
  (workdir / "timeline.json").write_text(json.dumps(timeline))
  return str(workdir)


@pytest.mark.parametrize("saves_where", [None, "top", "session"])
def test_the_workdir_gives_the_timeline_the_train_phase_step_and_each_saves_stall_where_recorded(
    tmp_path, saves_where):
  r = kit_train.read_workdir(_workdir(tmp_path, saves_where), SCHEDULE)
  assert r["timeline"] == {"compile_s": 40.0, "train_s": 2.5, "eval_s": 3.0, "save_s": 2.05, "total_s": 50.0,
                           "compiles": 7, "num_sessions": 1}
  assert r["steps_done"] == 100 and r["train_phase_ms_per_step"] == pytest.approx(25.0)
  assert r["steady_ms_per_step"] == 20.0
  assert r["saves"] == (None if saves_where is None else [{"step": 50, "seconds": 0.8}, {"step": 100, "seconds": 1.25}])


def test_the_report_sets_the_trainer_beside_the_b50_point(tmp_path):
  result = {"passed": True, "schedule": SCHEDULE, "attention": "fused",
            **kit_train.read_workdir(_workdir(tmp_path, "top"), SCHEDULE)}
  b50 = {"name": "b50", "ok": True, "pipelined_step_ms": 12.5, "profile": {"gpu_ms_per_step": 8.0}}
  s = kit_train.train_summary({"step": "train", "ok": True, "seconds": 70.0, "result": result}, b50)
  assert s["ratio_to_bench_step"] == pytest.approx(20.0 / 12.5) and s["ratio_to_gpu_op_time"] == pytest.approx(2.5)
  text = "\n".join(kit_train.train_lines(s))
  assert "Steady step **20.00 ms** (median of 5 log intervals" in text
  assert "the train phase 25.00 ms per step" in text and "1.60x its pipelined step (12.50 ms)" in text
  assert "2.50x its GPU op time per step (8.00 ms)" in text
  assert "| compile | train | eval | save | total | compiles |" in text and "| 40.0 | 2.5 | 3.0 | 2.0 | 50.0 | 7 |" in text
  assert "Each save's stall: step 50: 0.80 s, step 100: 1.25 s." in text
  s = kit_train.train_summary({"step": "train", "ok": True, "result": dict(result, saves=None)}, None)
  assert s["ratio_to_bench_step"] is None
  assert "Each save's stall: not recorded by this trainer" in "\n".join(kit_train.train_lines(s))


def test_the_trainer_command_takes_the_kits_model_data_gate_and_extra_fields(tmp_path, monkeypatch):
  monkeypatch.setenv("MICSE_DATA_DIR", str(tmp_path / "data"))
  monkeypatch.setattr(kit_plan, "TRAIN_OVERRIDES", {"steps_per_dispatch": "auto"})
  args = kit_train.trainer_args("/m", "/w", "/c", dry=False, explicit=True)
  assert args[:3] == [sys.executable, "-m", "micse_jax.main"] and args[args.index("--workdir") + 1] == "/w"
  assert args[args.index("--config") + 1].endswith(os.path.join("configs", "micse.py"))
  fields = dict(a[len("--config."):].split("=", 1) for a in args if a.startswith("--config."))
  assert fields == {"model.name_or_path": "/m", "data.corpus": str(tmp_path / "data" / "corpus" / "wiki1m_head.txt"),
                    "num_train_steps": "1500", "eval_every": "125", "checkpoint_every": "250", "log_every": "10",
                    "eval.final_tasks": "", "cache.dir": "/c", "model.attention": "explicit",
                    "steps_per_dispatch": "auto"}
  dry = kit_train.trainer_args("/m", "/w", "/c", dry=True, explicit=False)
  assert "--config.num_train_steps=40" in dry and not any("attention" in a for a in dry)


def _fake_trainer(tmp_path, monkeypatch, body):
  script = tmp_path / "trainer.py"
  script.write_text(textwrap.dedent(body))
  monkeypatch.setattr(kit_train, "trainer_args", lambda model, workdir, cache, dry, explicit: [
      sys.executable, str(script), workdir])


def test_the_train_step_runs_the_trainer_and_reads_its_workdir_or_says_it_was_cut(tmp_path, monkeypatch):
  source = _workdir(tmp_path / "made", "top")
  _fake_trainer(tmp_path, monkeypatch, f"""
      import shutil, sys
      print("training", flush=True)
      shutil.copytree({source!r}, sys.argv[1])
      """)
  r = kit_train.train(str(tmp_path / "state"), "/m", dry=True, explicit=False, timeout_s=60)
  assert r["passed"] and not r["timed_out"] and "training" in r["tail"]
  assert r["steady_ms_per_step"] is not None and r["timeline"]["compiles"] == 7
  _fake_trainer(tmp_path, monkeypatch, """
      import time
      print("compiling", flush=True)
      time.sleep(60)
      """)
  r = kit_train.train(str(tmp_path / "state"), "/m", dry=True, explicit=False, timeout_s=2)
  assert r["timed_out"] and not r["passed"] and r["seconds"] < 30 and r["timeline"] == {}
  assert not os.path.exists(tmp_path / "state" / "train" / "workdir")  # the first run's workdir went first


def test_the_lease_steps_run_in_the_two_commands_within_one_lease(tmp_path, monkeypatch):
  """Every step taking its planned seconds (a fake clock), the first command's budget and the
  second's run every step of the lease's plan, each command within the tool's limit, and the
  lease's device seconds (start, install, processes, transfers, the idle gap) leave the margin."""
  clock, ran = [0.0], []

  def fake_measure(the_kit, name):
    ran.append(name)
    clock[0] += kit_plan.planned(False)[name]
    return {}
  monkeypatch.setattr(kit, "measure", fake_measure)
  monkeypatch.setattr(kit.time, "monotonic", lambda: clock[0])
  monkeypatch.setattr(kit_report, "setup_facts", lambda: {"device_kind": "NVIDIA H200", "date": "d"})
  monkeypatch.setattr(kit_report, "write", lambda *args: None)  # the reports of empty results: not this test's
  monkeypatch.setattr(kit_report, "summary", lambda rows: {"points": []})
  commands = []
  for budget in kit_plan.COMMAND_BUDGETS_S:
    ran.clear()
    kit.main([str(tmp_path / "out"), "--state", str(tmp_path / "state"), "--budget_s", str(budget)])
    commands.append(list(ran))
  assert sorted(commands[0] + commands[1]) == sorted(kit_plan.LEASE_STEPS)
  assert commands[1] == ["train"]
  for budget in kit_plan.COMMAND_BUDGETS_S:
    assert kit_plan.INSTALL_S + kit_plan.PROCESS_S + budget <= kit_plan.COMMAND_LIMIT_S - kit_plan.MARGIN_S
  assert kit_plan.lease_seconds() + kit_plan.MARGIN_S <= kit_plan.LEASE_S


def test_the_acceptance_doc_states_the_plan_and_the_first_commands_steps():
  """docs/GPU_ACCEPTANCE.md's plan table names every step of `kit_plan.PLAN` in its order with its
  planned seconds (the rows after `train` being those beyond the lease), and the lease's arithmetic
  lists the first command's steps with their seconds, summing to its budget: the doc a lease is
  run from says what the kit will do."""
  import re
  doc = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                          "GPU_ACCEPTANCE.md"), encoding="utf-8").read()
  table = doc[doc.index("| step | planned s |"):doc.index("**The kernels are proven")]
  rows = []
  for line in table.splitlines()[2:]:
    if line.startswith("| `"):
      cells = line.split("|")[1:3]
      names, seconds = re.findall(r"`([a-z0-9_]+)`", cells[0]), [int(x) for x in re.findall(r"\d+", cells[1])]
      assert len(names) == len(seconds), line
      rows += zip(names, seconds)
  assert rows == [(s.name, s.planned_s) for s in kit_plan.PLAN]
  first = re.search(r"first command: .* the steps (\d+) \((.*?)\), transfers", doc)
  listed = re.findall(r"`([a-z0-9_]+)` (\d+)", first.group(2))
  lease = [n for n in kit_plan.LEASE_STEPS if n != "train"]
  assert [n for n, _ in listed] == [n for n in lease if "_torch_eager" not in n]
  eager = sum(kit_plan.planned(False)[n] for n in lease if "_torch_eager" in n)
  assert f"both eager peers {eager}" in first.group(2)
  assert all(int(s) == kit_plan.planned(False)[n] for n, s in listed)
  assert int(first.group(1)) == kit_plan.COMMAND_BUDGETS_S[0] == sum(kit_plan.planned(False)[n] for n in lease)
  assert f"**the lease** | **{kit_plan.lease_seconds()} of {kit_plan.LEASE_S}**" in doc
