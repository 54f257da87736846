"""The GPU kit's `gpu_tests` step without a GPU (`benchmarks/kit_gate.py`): the gate, the trial tests
and the other GPU tests started at once, the gate's verdict ("passed", "failed", "not proven
(time-out)") alone deciding, runs cut at one time-out with nothing left running, outcomes and
seconds per test read back from pytest with xdist, the longest tests first."""
import os
import signal
import subprocess
import sys
import textwrap
import types

import pytest

from benchmarks import kit, kit_gate, kit_kernels, kit_pytest, kit_report


def _fake_result(files, verdict="passed", timed_out=False):
  return {"returncode": None if timed_out else int(verdict != "passed"), "tests": 1, "failures": 0, "errors": 0,
          "skipped": 0, "outcomes": {}, "seconds": {}, "files": files, "passed": verdict == "passed",
          "timed_out": timed_out, "tail": "", "failed_before_cut": False, "verdict": verdict}


def test_the_gate_trial_and_other_tests_start_together_and_the_gate_alone_decides(monkeypatch):
  """Three runs at once: the gate on the kernels' file (autotuning off, full priority), the trial tests
  on it (autotuning off, niced) and the other files (as the trainer compiles, niced); one deadline
  for all; the step's result is the gate's, a time-out of the others deciding nothing."""
  started, deadlines = [], []
  monkeypatch.setattr(kit_gate, "_start", lambda markers, files, workers, env, nice: started.append(
      (markers, files, workers, env.get("XLA_FLAGS", ""), nice)) or files)
  monkeypatch.setattr(kit_gate.time, "monotonic", lambda: 1000.0)

  def finish(runs, deadline):
    deadlines.append(deadline)
    return [_fake_result(runs[0]), _fake_result(runs[1], "failed"), _fake_result(runs[2], "not proven (time-out)", True)]
  monkeypatch.setattr(kit_gate, "_finish", finish)
  result = kit_gate.gpu_tests(100)
  others = [f for f in kit_gate.gpu_test_files() if f not in kit_gate.GATE_FILES]
  gate = list(kit_gate.GATE_FILES)
  proof = f"{os.environ.get('XLA_FLAGS', '')} {kit_gate.PROOF_XLA_FLAGS}".strip()  # this process's flags kept
  assert others and started == [
      ("gpu and not trial", gate, kit_gate.GATE_WORKERS, proof, 0),
      ("gpu and trial", gate, kit_gate.TRIAL_WORKERS, proof, kit_gate.LOW_PRIORITY),
      ("gpu and not trial", others, kit_gate.OTHERS_WORKERS, "", kit_gate.LOW_PRIORITY)]
  assert deadlines == [1100.0]
  assert result["verdict"] == "passed" and result["files"] == gate
  assert result["trial"]["verdict"] == "failed" and result["others"]["timed_out"]
  lines = kit_kernels.gpu_tests_lines(result)
  assert "- the other files' GPU tests (they decide nothing): none ran (cut at the time-out)" in lines


@pytest.mark.parametrize("gate,proven,line", [
    ("passed", True, "`gpu_tests` passed"),
    ("failed", False, "**`gpu_tests` failed: the kit's points train on the explicit path**"),
    ("not proven (time-out)", False, "**`gpu_tests` not proven (time-out): the kit's points train on the explicit path**")])
def test_a_gate_cut_by_its_time_out_is_not_proven_and_keeps_the_points_on_the_explicit_path(
    tmp_path, monkeypatch, gate, proven, line):
  monkeypatch.setattr(kit_report, "setup_facts", lambda: {"device_kind": "NVIDIA H200", "date": "d"})
  the_kit = kit.Kit(kit.parse_args([str(tmp_path / "out"), "--state", str(tmp_path / "state")]))
  result = _fake_result(["tests/dropout_attention_test.py"], gate, gate.startswith("not proven"))
  the_kit.add({"step": "gpu_tests", "ok": result["passed"], "seconds": 100.0, "result": result})
  assert kit.kernels_proven(the_kit) is proven
  summary = kit_report.summary(the_kit.rows())
  assert summary["gate"] == gate and line in summary["kernels"]
  assert f"(tests/dropout_attention_test.py): **{gate}**" in (tmp_path / "out" / "kit.md").read_text()


def _script_run(tmp_path, name, body, monkeypatch):
  """A run of `body` (a Python script standing in for pytest) started by the gate's own starter."""
  script = tmp_path / f"{name}.py"
  script.write_text(textwrap.dedent(body))
  monkeypatch.setattr(kit_gate, "_command", lambda *args: [sys.executable, str(script)])
  return kit_gate._start("gpu", [name], 1, {}, 0)


def test_runs_cut_at_the_deadline_are_failed_only_where_a_test_failed_before_the_cut(tmp_path, monkeypatch):
  """Four runs, one deadline: one passes, one fails at once, one is cut after a passing test (not
  proven), one is cut after a failing test (failed); the cut ones get SIGINT, and their whole group,
  a grandchild that ignores SIGINT included, is gone when the step returns."""
  pid_file = tmp_path / "grandchild.pid"
  passes = _script_run(tmp_path, "passes", "print('tests/a_test.py::test_one PASSED')\n", monkeypatch)
  fails = _script_run(tmp_path, "fails", "print('tests/a_test.py::test_one FAILED'); raise SystemExit(1)\n",
                      monkeypatch)
  slow = f"""
      import signal, subprocess, sys, time
      g = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)'])
      open({str(pid_file)!r}, 'w').write(str(g.pid))
      print('[gw0] [ 50%] {{}} tests/a_test.py::test_one', flush=True)
      try:
        time.sleep(60)
      except KeyboardInterrupt:
        print('[gw1] [100%] FAILED tests/a_test.py::test_two', flush=True)  # the test the cut interrupted
        raise SystemExit(2)
      """
  cut = _script_run(tmp_path, "cut", slow.format("PASSED"), monkeypatch)
  cut_failing = _script_run(tmp_path, "cut_failing", slow.format("FAILED").replace(str(pid_file), str(pid_file) + "2"),
                            monkeypatch)
  results = kit_gate._finish([passes, fails, cut, cut_failing], kit_gate.time.monotonic() + 4, grace_s=5)
  assert [r["verdict"] for r in results] == ["passed", "failed", "not proven (time-out)", "failed"]
  assert [r["timed_out"] for r in results] == [False, False, True, True]
  assert results[2]["outcomes"] == {"test_one": "passed", "test_two": "failed"}  # reported, not the verdict
  for path in (pid_file, tmp_path / "grandchild.pid2"):
    grandchild = int(path.read_text())
    state = open(f"/proc/{grandchild}/stat").read().split()[2] if os.path.exists(f"/proc/{grandchild}") else "gone"
    assert state in ("gone", "Z", "X")


FAKE_GPU_TESTS = '''
import time
import pytest

@pytest.mark.gpu
def test_quick():
  pass

@pytest.mark.gpu
def test_slow():
  time.sleep(SLEEP)

@pytest.mark.gpu
def test_another():
  pass

@pytest.mark.gpu
@pytest.mark.trial
def test_trial():
  raise AssertionError("a trial test: not in the gate")
'''


@pytest.mark.parametrize("sleep,verdict", [(1, "passed"), (60, "not proven (time-out)")])
def test_real_pytest_with_xdist_reports_outcomes_and_seconds_or_is_cut_as_not_proven(tmp_path, sleep, verdict):
  """The gate's own command line (xdist workers, the ordering plugin, JUnit XML) on a file of fake GPU
  tests: outcomes and seconds per test, or, cut by the deadline, what ran and "not proven"."""
  path = tmp_path / "fake_gpu_test.py"
  path.write_text(FAKE_GPU_TESTS.replace("SLEEP", str(sleep)))
  run = kit_gate._start("gpu and not trial", [str(path)], 2, {}, 0)
  result, = kit_gate._finish([run], kit_gate.time.monotonic() + (60 if sleep == 1 else 12))
  assert result["verdict"] == verdict, result["tail"]
  assert result["outcomes"]["test_quick"] == "passed" and "test_trial" not in result["outcomes"]
  if sleep == 1:
    assert result["tests"] == 3 and result["seconds"]["test_slow"] >= 1.0
  assert kit_gate.live_members(run.proc.pid) == []


def test_live_lines_of_one_process_and_of_xdist_workers_are_read():
  output = ("tests/a_test.py::test_x[T16-d64] PASSED\n[gw3] [ 40%] FAILED tests/a_test.py::test_y\n"
            "[gw0] [100%] SKIPPED tests/b_test.py::test_z\nnoise PASSED\n")
  assert kit_gate.live_outcomes(output) == {"test_x[T16-d64]": "passed", "test_y": "failed", "test_z": "skipped"}


def test_the_gate_starts_its_longest_tests_first():
  names = ["test_on_gpu_population_members_keep_their_own_masks_and_gradients", "test_unknown_b",
           "test_on_gpu_a_batch_50_step_with_the_kernels_is_the_explicit_paths", "test_unknown_a",
           "test_on_gpu_the_kernels_run_and_match_reference[T128-d128-bfloat16]"]
  items = [types.SimpleNamespace(name=n) for n in names]
  kit_pytest.pytest_collection_modifyitems(None, items)
  assert [i.name for i in items] == [names[4], names[2], names[0], names[1], names[3]]  # ties keep their order


def test_a_killed_group_is_waited_for_until_no_member_runs():
  """The kit's wait after `killpg` sees a live member of the group and returns once it has died."""
  sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
  try:
    assert kit_gate.live_members(sleeper.pid) == [sleeper.pid]
    os.killpg(sleeper.pid, signal.SIGKILL)
    kit_gate.wait_for_group_gone(sleeper.pid, timeout_s=10)
    assert kit_gate.live_members(sleeper.pid) == []
  finally:
    sleeper.kill()
    sleeper.wait()
