"""Crash safety, proven with a real kill: `python -m micse_jax.main` is SIGKILLed in the middle of
its first save, mid-run and once while a later checkpoint is being written; re-running the same
command resumes, and the final train state equals that of an uninterrupted run exactly (CPU); the
killed session's time is in timeline.json up to its last checkpoint, which never claims a step whose
save had not committed."""
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from micse_jax import jsonio
from micse_jax import workdir as workdir_lib
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4  # the tiny run's length (`tiny_training_config`), a save after every step: its program is the one
# other tests compile, read from the suite's compilation cache where one did


def _command(config, workdir):
  overrides = {"model.name_or_path": config.model.name_or_path, "data.corpus": config.data.corpus,
               "batch_size": 8, "num_train_steps": STEPS, "checkpoint_every": 1, "log_every": 1,
               "eval_every": 0, "eval.final_tasks": "", "model.max_length": 16,
               "momentum.queue_size": 12, "ami.layers": "(0,1)", "ami.num_samples": 20,
               "optim.warmup_steps": 2, "optim.learning_rate": 1e-3}
  return [sys.executable, "-m", "micse_jax.main", "--config", "configs/micse.py",
          "--workdir", str(workdir), *[f"--config.{k}={v}" for k, v in overrides.items()]]


def _env():
  """The same compiled step for every run: JAX's persistent cache, the test session's (the trainer opens it
  under the inherited $XDG_CACHE_HOME, `conftest.py`; also saves compile time)."""
  return {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}


def _entries(workdir):
  folder = os.path.join(workdir, workdir_lib.ROLLING_DIR)
  return os.listdir(folder) if os.path.isdir(folder) else []


# `python -m micse_jax.main` with every Orbax save committed (its folder renamed into place) 5 s late:
# a kill in the middle of the first save is then certain to find it unfinished.
SLOW_COMMIT = """import time
import orbax.checkpoint as ocp
finalize = ocp.CheckpointManager._finalize
def finalize_late(self, *args, **kwargs):
  time.sleep(5)
  return finalize(self, *args, **kwargs)
ocp.CheckpointManager._finalize = finalize_late
from micse_jax import main
main.run()
"""


def _slow_commit(cmd):
  """`cmd` (a `python -m micse_jax.main ...` command) with the saves committed late (`SLOW_COMMIT`)."""
  assert cmd[1:3] == ["-m", "micse_jax.main"]
  return [cmd[0], "-c", SLOW_COMMIT, *cmd[3:]]


def _sessions(path) -> int:
  """Sessions in a timeline file (0 while it does not exist or is being replaced)."""
  try:
    return len(jsonio.read_json(str(path))["sessions"])
  except (OSError, ValueError, KeyError):
    return 0


def _committed(workdir):
  return sorted(int(n) for n in _entries(workdir) if n.isdigit())


def _temporaries(workdir):
  """Orbax writes a save into a temporary folder, renamed to `<step>` once complete."""
  return {n for n in _entries(workdir) if "tmp" in n}


def _run_and_kill(cmd, env, log_path, condition, timeout=600):
  """Starts `cmd`; SIGKILLs it as soon as `condition()` holds. Returns whether it was killed."""
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
      if condition():
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        return True
      time.sleep(0.002)
    proc.kill()
    proc.wait()
  return False


def _run(cmd, env, log_path):
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=600,
                          check=False)
  assert proc.returncode == 0, open(log_path, encoding="utf-8").read()[-3000:]


def _final_state(workdir):
  manager = workdir_lib.rolling_manager(str(workdir), keep=0, read_only=True)
  assert manager.latest_step() == STEPS
  return manager.restore(STEPS, args=ocp.args.PyTreeRestore())


def _first_progress_step(log_path):
  """The step the progress bar starts from (tqdm `initial=`): 0 fresh, k when resumed."""
  text = open(log_path, encoding="utf-8").read()
  match = re.search(rf"train:[^|]*\|[^|]*\|\s*(\d+)/{STEPS}", text)
  assert match, text[-2000:]
  return int(match.group(1))


def _assert_killed_session_recorded(path, committed: list[int], sessions: int) -> None:
  """The SIGKILLed session (the `sessions`-th) is on record up to a checkpoint: its time, and as the step
  it reached one whose save had committed when it was killed (`committed`), or none (0)."""
  document = jsonio.read_json(str(path))
  assert document["num_sessions"] == sessions
  session = document["sessions"][-1]
  assert not session["finished"] and session["steps"]["from"] == 0
  assert session["steps"]["to"] in [0, *committed], (session["steps"], committed)
  assert session["compile_s"] > 0 and session["train_s"] > 0
  assert session["total_s"] >= session["compile_s"] + session["train_s"]
  assert document["total_s"] == pytest.approx(sum(s["total_s"] for s in document["sessions"]), abs=1e-2)


def test_sigkill_mid_run_and_mid_checkpoint_then_resume_equals_uninterrupted(tmp_path, minilm_dir):
  config = tiny_training_config(tmp_path, minilm_dir)
  assert config.num_train_steps == STEPS  # the tiny run's program (saves do not change it)
  env = _env()
  reference, crashed = tmp_path / "reference", tmp_path / "crashed"
  _run(_command(config, reference), env, tmp_path / "reference.log")

  cmd = _command(config, crashed)
  timeline_file = crashed / workdir_lib.TIMELINE_FILE
  # 0. killed in the middle of the first save (written, not yet committed), its timeline written at that save.
  assert _run_and_kill(_slow_commit(cmd), env, tmp_path / "kill0.log",
                       lambda: _temporaries(crashed) and _sessions(timeline_file) == 1), "no first save caught"
  assert _committed(crashed) == []
  _assert_killed_session_recorded(timeline_file, [], sessions=1)  # step 2 was never committed: not claimed
  # 1. killed mid-run: right after the first checkpoint is committed (and its timeline written), between saves.
  assert _run_and_kill(cmd, env, tmp_path / "kill1.log", lambda: _committed(crashed) and _sessions(timeline_file) == 2), \
      "the run finished before it could be killed"
  assert _first_progress_step(tmp_path / "kill1.log") == 0  # the first save never committed: from the start
  after_first = _committed(crashed)
  assert after_first and after_first[-1] < STEPS
  _assert_killed_session_recorded(timeline_file, after_first, sessions=2)
  # 2. killed while a later checkpoint is being written (a new Orbax temporary folder exists).
  leftovers = _temporaries(crashed)
  assert _run_and_kill(cmd, env, tmp_path / "kill2.log",
                       lambda: bool(_temporaries(crashed) - leftovers)), \
      "no checkpoint write was caught in progress"
  resume_from = _committed(crashed)[-1]
  assert resume_from < STEPS
  # 3. the same command again: resumes from the last committed checkpoint and completes.
  _run(cmd, env, tmp_path / "resume.log")
  assert _first_progress_step(tmp_path / "kill2.log") == after_first[-1]
  assert _first_progress_step(tmp_path / "resume.log") == resume_from > 0

  document = jsonio.read_json(str(timeline_file))  # one entry per session, the resume's finished
  assert len({s["id"] for s in document["sessions"]}) == document["num_sessions"] >= 3
  assert document["sessions"][-1]["finished"] and document["sessions"][-1]["steps"]["to"] == STEPS
  assert document["total_s"] == pytest.approx(sum(s["total_s"] for s in document["sessions"]), abs=1e-2)

  want, got = _final_state(reference), _final_state(crashed)
  assert jax.tree.structure(want) == jax.tree.structure(got)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
