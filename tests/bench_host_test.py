"""`python -m micse_jax.bench --host` on tiny sizes: the report and the shape of its last JSON line."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args):
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "micse_jax.bench", "--host", "--model", "tiny",
                         "--host_sentences", "600", "--host_steps", "2", "--batch_size", "4", *args],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()


def _check_json_line(line):
  result = json.loads(line)
  assert list(result) == ["host_ms_per_step"]
  table = result["host_ms_per_step"]
  assert sorted(table) == ["prepared", "text"]
  for source in table.values():
    assert sorted(source) == ["50", "512"]
    assert all(isinstance(v, float) and v > 0 for v in source.values())


def test_host_flag_prints_the_json_line_last(tmp_path, shared_data):
  lines = _bench("--no-host_dev", "--output", str(tmp_path / "host.json"))
  _check_json_line(lines[-1])
  assert any(line.strip().startswith("prepared  batch  512") for line in lines)
  saved = json.loads((tmp_path / "host.json").read_text(encoding="utf-8"))
  assert saved["host_ms_per_step"] == json.loads(lines[-1])["host_ms_per_step"]


@pytest.mark.slow
def test_host_flag_states_dev_selection_overhead(senteval_dir):
  lines = _bench("--eval_every", "125")
  _check_json_line(lines[-1])
  assert any("dev selection" in line and "% of step time" in line for line in lines)
