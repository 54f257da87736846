"""The GPU acceptance kit (scripts/device, bench/acceptance*.py) without a GPU: its report, its
dependency resolution for the image, and (slow) the whole kit run in CPU dry mode in a Python 3.12
venv like the lent image, with only the kit's wheels added offline."""
import email.message
import importlib.util
import json
import math
import os
import subprocess

import pytest

from micse_jax.bench import acceptance_report
from micse_jax.bench.rows import append_json_line, read_json_lines

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_VENV = os.environ.get("MICSE_IMAGE_VENV", os.path.expanduser("~/.cache/micse_jax/image-venv-py312"))
KIT = os.environ.get("MICSE_KIT_DIR", os.path.join(REPO, ".kit"))


def _kit_wheels_module():
  spec = importlib.util.spec_from_file_location("kit_wheels", os.path.join(REPO, "scripts", "device", "kit_wheels.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_kit_resolver_reads_requirements_for_python_312_linux_with_extras():
  kw = _kit_wheels_module()
  meta = email.message.Message()
  for line in ("absl-py", "toml; python_version >= '3.8'", "importlib-resources; python_version < '3.9'",
               "pywin32; sys_platform == 'win32'", "fsspec; extra == 'epath'", "zipp; extra == 'epath'",
               "einops; extra == 'enp'"):
    meta["Requires-Dist"] = line
  names = lambda reqs: sorted(r.name for r in reqs)
  assert names(kw.requires(meta, set())) == ["absl-py", "toml"]
  assert names(kw.requires(meta, {"epath"})) == ["absl-py", "fsspec", "toml", "zipp"]
  assert names(kw.requires(meta, {"epath"}, only_extras=True)) == ["fsspec", "zipp"]
  image = kw.image_packages()
  assert {"jax", "torch", "flax", "optax", "orbax-checkpoint", "transformers", "scipy"} <= image
  assert not image & {"ml-collections", "grain", "array-record", "tensorflow-datasets", "tensorboardx",
                      "submitit", "jmp"}  # what the issue says the image lacks


def _bench_row(dtype, batch, step_ms, torch_ms, ok=True):
  result = {"device": "NVIDIA H100 80GB HBM3", "compile_s": 40.0,
            "jax": {"step_ms": step_ms, "sentences_per_s": batch / step_ms * 1e3, "mfu": 0.25,
                    "peak_device_bytes": 3 * 2 ** 30}} if ok else {}
  if ok and torch_ms:
    result.update(torch={"step_ms": torch_ms, "peak_device_bytes": 2 ** 31}, speedup_vs_torch=torch_ms / step_ms,
                  torch_compiled={"step_ms": 18.0}, speedup_vs_torch_compiled=18.0 / step_ms)
  return {"row": "bench", "dtype": dtype, "batch_size": batch, "ok": ok,
          "returncode": 0 if ok else "timeout", "result": result, "tail": "" if ok else "killed"}


def test_acceptance_report_projects_the_paper_run_and_survives_a_cut_last_line(tmp_path):
  rows = tmp_path / "acceptance.jsonl"
  append_json_line(str(rows), {"row": "gpu_tests", "ok": True, "returncode": 0, "tests": 3, "failures": 0,
                               "errors": 0, "skipped": 0})
  append_json_line(str(rows), _bench_row("bfloat16", 50, 12.0, 30.0))
  append_json_line(str(rows), _bench_row("float16", 512, None, None, ok=False))
  with open(rows, "a", encoding="utf-8") as f:
    f.write('{"row": "bench", "dtype": "flo')  # a process killed while writing
  assert len(read_json_lines(str(rows))) == 3
  text = acceptance_report.write(str(tmp_path), [str(rows)])
  report = json.loads((tmp_path / "acceptance.json").read_text())
  ok, failed = report["bench"]
  assert ok["projected_paper_run_hours"] == pytest.approx(20_000 * 12.0 / 3.6e6)  # 20k steps x 12 ms
  assert ok["ratio_torch_over_jax"] == pytest.approx(2.5) and ok["mfu"] == 0.25
  assert failed["status"] == "timeout" and failed["step_ms"] is None
  assert "| bfloat16 | 50 | ok | 40.0 | 12.00 | 4167 | 25.0% | 3.00 | 30.00 | 2.00 | 2.50 | 18.00 | 1.50 | 0.07 |" in text
  assert "3 run, 0 failed" in text and "float16 512: timeout" in text
  assert (tmp_path / "acceptance.md").read_text() == text


def test_acceptance_report_shows_the_host_row(tmp_path):
  rows = tmp_path / "acceptance.jsonl"
  dev = {"dev_sentences": 2758, "dev_eval_ms": 400.0, "eval_every": 125, "step_ms": 16.0,
         "fraction_of_step_time": 400.0 / (125 * 16.0)}
  append_json_line(str(rows), {"row": "host", "ok": True, "returncode": 0, "result": {
      "host_ms_per_step": {"text": {"50": 0.1, "512": 0.25}, "prepared": {"50": 0.5, "512": 2.25}},
      "dev_selection": dev}})
  text = acceptance_report.write(str(tmp_path), [str(rows)])
  assert "| text corpus | 0.100 | 0.250 |" in text and "| prepared corpus | 0.500 | 2.250 |" in text
  assert "400.0 ms against 125 train steps of 16.00 ms: **20.00 %** of step time" in text  # 400 / 2000
  assert json.loads((tmp_path / "acceptance.json").read_text())["host"][0]["result"]["dev_selection"] == dev


def test_report_sets_the_aot_prediction_beside_the_measured_point_and_lists_caches(tmp_path):
  rows = tmp_path / "acceptance.jsonl"
  point = _bench_row("bfloat16", 50, 16.0, 75.0)
  point["result"].update(kernels_per_step=1650, update_kernels_per_step=470)
  append_json_line(str(rows), point)
  append_json_line(str(rows), {"row": "aot", "ok": True, "returncode": 0, "result": {
      "dtype": "bfloat16", "batch_size": 50, "model": "bert-base", "device_kind": "NVIDIA H100 80GB HBM3",
      "kernels_per_step": 1702, "update_kernels_per_step": 482, "peak_bytes_per_device": 3.5 * 2 ** 30}})
  append_json_line(str(rows), {"row": "model_caches", "ok": True, "returncode": 0, "caches": {
      "/root/.cache/huggingface": {"bytes": 3 * 2 ** 20, "entries": ["hub"]}}})
  append_json_line(str(rows), {"row": "encode_attention", "ok": True, "returncode": 0, "result": {
      "dtype": "bfloat16", "sentences": 1024, "batch_size": 128, "fused_sentences_per_s": 3000.0,
      "explicit_sentences_per_s": 2000.0, "speedup_fused_over_explicit": 1.5, "cudnn_attention_calls": 12,
      "max_abs_difference": 0.01}})
  text = acceptance_report.write(str(tmp_path), [str(rows)])
  assert "| `--aot h100` prediction | 1702 | 482 | 3.50 | — |" in text
  assert "| measured (NVIDIA H100 80GB HBM3) | 1650 | 470 | 3.00 | 16.00 |" in text
  assert "model caches on the image: /root/.cache/huggingface 3 MiB (hub)" in text
  assert "12 cuDNN attention calls" in text and "**1.50x**" in text


def test_model_caches_lists_sizes_and_entries(tmp_path, monkeypatch):
  from micse_jax.bench import acceptance
  hub = tmp_path / "hf" / "hub" / "models--org--name"
  hub.mkdir(parents=True)
  (hub / "weights.bin").write_bytes(b"x" * 1000)
  (tmp_path / "hf" / "token").write_bytes(b"y" * 24)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no cache under the default folders
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  for variable in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME", "SENTENCE_TRANSFORMERS_HOME"):
    monkeypatch.delenv(variable, raising=False)
  assert acceptance.model_caches() == {str(tmp_path / "hf"): {"bytes": 1024, "entries": ["hub", "hub/models--org--name"]}}


def test_bench_keeps_rows_measured_before_a_late_failure(tmp_path, monkeypatch):
  """The PyTorch baseline fails after the micse_jax step was measured: the rows file and the
  output file still hold the compile and step figures."""
  from micse_jax.bench import __main__ as bench
  from micse_jax.bench import torch_step

  def broken(*args, **kwargs):
    raise RuntimeError("CUDA out of memory (simulated)")
  monkeypatch.setattr(torch_step, "torch_benchmark", broken)
  rows, output = tmp_path / "rows.jsonl", tmp_path / "out.json"
  with pytest.raises(RuntimeError, match="simulated"):
    bench.main(["--model", "tiny", "--batch_size", "4", "--max_length", "16", "--steps", "1", "--warmup", "1",
                "--no_breakdown", "--no-encode", "--rows", str(rows), "--output", str(output)])
  saved = read_json_lines(str(rows))
  assert [r["row"] for r in saved] == ["setup", "compile", "jax"]
  assert all(r["batch_size"] == 4 and r["dtype"] == "float32" for r in saved)
  assert saved[2]["jax"]["step_ms"] > 0 and saved[1]["compile_s"] > 0
  assert json.loads(output.read_text())["jax"] == saved[2]["jax"]


@pytest.mark.slow
def test_acceptance_kit_runs_to_the_end_in_cpu_dry_mode_in_an_image_like_venv(tmp_path):
  python = os.path.join(IMAGE_VENV, "bin", "python")
  if not os.path.isfile(python):
    pytest.skip(f"no image-like venv at {IMAGE_VENV} (set MICSE_IMAGE_VENV): build it once with "
                "scripts/device/image_venv.sh (needs the package registry)")
  if not os.path.isdir(os.path.join(KIT, "wheels")):
    pytest.skip(f"no kit at {KIT} (set MICSE_KIT_DIR): build it with scripts/device/wheels.sh (needs the registry)")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MICSE_DATA_DIR", "XLA_FLAGS")}
  lacks = subprocess.run([python, "-c", "import ml_collections"], env=env, capture_output=True)
  assert lacks.returncode != 0, "the image-like venv must not have what the kit brings"
  out = tmp_path / "out"
  proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "device", "acceptance.sh"), str(out), "--dry",
                         "--kit", KIT], env=dict(env, PYTHON=python, MICSE_KIT_SITE=str(tmp_path / "site")),
                        capture_output=True, text=True, timeout=3600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((out / "acceptance.json").read_text())
  (tests,), (train,) = report["gpu_tests"], report["train"]
  assert tests["ok"] and tests["tests"] >= 1 and tests["skipped"] == tests["tests"]  # no GPU: all skip
  assert [(b["dtype"], b["ok"]) for b in report["bench"]] == [("float32", True), ("bfloat16", True), ("float16", True)]
  for b in report["bench"]:
    assert b["step_ms"] > 0 and b["torch_step_ms"] > 0 and b["compile_s"] > 0
    assert b["ratio_torch_over_jax"] == pytest.approx(b["torch_step_ms"] / b["step_ms"])
    assert b["projected_paper_run_hours"] == pytest.approx(math.ceil(1e6 / b["batch_size"]) * b["step_ms"] / 3.6e6)
  assert report["bench"][0]["profile_ms_per_step_by_kind"]["matrix multiply"] > 0
  assert train["ok"] and len(train["sts"]) == 7
  assert all(-100 <= v <= 100 for v in train["sts"].values())
  assert report["kit_imports"][0]["ok"], report["kit_imports"]
  (host,) = report["host"]
  assert host["ok"], host["tail"]
  per_step, dev = host["result"]["host_ms_per_step"], host["result"]["dev_selection"]
  assert sorted(per_step) == ["prepared", "text"] and all(v > 0 for s in per_step.values() for v in s.values())
  assert dev["fraction_of_step_time"] == pytest.approx(dev["dev_eval_ms"] / (dev["eval_every"] * dev["step_ms"]))
  (aot,), (encode,), (caches,) = report["aot"], report["encode_attention"], report["model_caches"]
  assert caches["ok"] and encode["ok"] and encode["result"]["cudnn_attention_calls"] == 0  # CPU: XLA attention
  assert aot["ok"] or "jax-cuda13-plugin" in aot["tail"], aot["tail"]  # the image-like venv may lack the plugin
  (pop,) = report["population"]
  assert pop["ok"], pop["tail"]
  assert [m["members"] for m in pop["result"]["population"]] == [1, 2]
  assert len(read_json_lines(str(out / "acceptance.jsonl"))) == 11
  md = (out / "acceptance.md").read_text()
  assert "CPU dry run" in md and "## miCSE training" in md and "| float16 | 4 | ok |" in md
  assert "## Population training (issue 27)" in md
  assert "## Host side" in md and f"**{100 * dev['fraction_of_step_time']:.2f} %** of step time" in md
  assert (out / "acceptance.log").stat().st_size > 0
