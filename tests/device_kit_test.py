"""The GPU kit (benchmarks/, scripts/device/) without a GPU: its reports and what comes back,
its plan over two commands, installing a returned calibration point, the kernel table of a
GPU trace, the wheels' resolution for the image, and (slow) the whole kit in CPU dry mode."""
import email.message
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from benchmarks import kit, kit_plan, kit_points, kit_report, kit_train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE_VENV = os.environ.get("MICSE_IMAGE_VENV", os.path.expanduser("~/.cache/micse_jax/image-venv-py312"))
KIT = os.environ.get("MICSE_KIT_DIR", os.path.join(REPO, ".kit"))
RETURNED = re.compile(r"^[A-Za-z0-9._-]+$")  # the device tool returns such names only


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


def test_model_caches_lists_sizes_and_entries(tmp_path, monkeypatch):
  hub = tmp_path / "hf" / "hub" / "models--org--name"
  hub.mkdir(parents=True)
  (hub / "weights.bin").write_bytes(b"x" * 1000)
  (tmp_path / "hf" / "token").write_bytes(b"y" * 24)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no cache under the default folders
  monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
  for variable in ("HF_HUB_CACHE", "TRANSFORMERS_CACHE", "TORCH_HOME", "SENTENCE_TRANSFORMERS_HOME"):
    monkeypatch.delenv(variable, raising=False)
  assert kit.model_caches() == {str(tmp_path / "hf"): {"bytes": 1024, "entries": ["hub", "hub/models--org--name"]}}


# ---------------------------------------------------------------- reports

def _profile(top=()):
  return {"platform": "gpu", "profiled_steps": 5, "gpu_ms_per_step": 10.0,
          "ms_per_step_by_kind": {"matrix multiply": 6.0, "elementwise fusion": 4.0},
          "ms_per_step_by_phase": {"encode (backward)": 7.5, "optimizer": 2.5}, "top_kernels": list(top)}


def _rows():
  kernel = {"kernel": "loop_add_fusion_3", "ms_per_step": 0.6, "launches_per_step": 12.0,
            "instructions": ["loop_add_fusion.3", "loop_add_fusion.9"], "instruction_count": 12, "phases": ["optimizer"]}
  solo = lambda b, pipelined, blocked: {"kind": "solo", "members": 1, "batch_size": b, "max_length": 32,
                                        "dtype": "bfloat16", "compile_s": 41.0, "pipelined_step_ms": pipelined,
                                        "steps_per_dispatch": 4, "cuda_graphs": "kernels",
                                        "timing": {"warmup": 3, "steps": 20, "rounds": 3, "profile_steps": 5},
                                        "blocked_step_ms": blocked, "pipelined_rounds_ms": [pipelined] * 3,
                                        "mfu": 0.2, "mfu_blocked": 0.15, "peak_device_bytes": 3 * 2 ** 30,
                                        "kernels_per_step": 886, "profile": _profile([kernel])}
  peer = lambda pipelined, blocked: {"kind": "torch", "pipelined_step_ms": pipelined, "blocked_step_ms": blocked,
                                     "pipelined_rounds_ms": [pipelined] * 3, "peak_device_bytes": 2 ** 31}
  population = dict(solo(50, 50.0, 55.0), kind="population", members=5, ms_per_member_step_pipelined=10.0,
                    timing={"warmup": 3, "steps": 10, "rounds": 3, "profile_steps": 3})
  setup = {"date": "2026-11-27", "device_kind": "NVIDIA H200", "commit": "abc1234", "python": "3.12.3",
           "jax": "0.11.2", "flax": "0.12.10", "torch": "2.11.0", "transformers": "5.17.0", "nvidia_smi": None}
  return [{"step": "setup", "ok": True, "setup": setup},
          {"step": "caches", "ok": True, "seconds": 3.0, "result": {"caches": {"/root/.cache/huggingface": {
              "bytes": 3 * 2 ** 20, "entries": ["hub"]}}, "modules": ["jmp"], "import_failures": {}}},
          {"step": "gpu_tests", "ok": False, "seconds": 70.0, "result": {
              "returncode": 1, "tests": 3, "failures": 1, "errors": 0, "skipped": 0, "files": ["tests/x_test.py"],
              "passed": False, "tail": "FAILED tests/x_test.py::test_y"}},
          {"step": "b50", "ok": True, "seconds": 60.0, "result": solo(50, 10.0, 13.5)},
          {"step": "b50_torch_eager", "ok": True, "seconds": 12.0, "result": peer(70.0, 72.9)},
          {"step": "b50_torch_compiled", "started": True},
          {"step": "b50_torch_compiled", "ok": True, "seconds": 70.0, "result": peer(40.0, 45.0)},
          {"step": "b512", "ok": False, "seconds": 5.0, "error": "RESOURCE_EXHAUSTED: out of memory", "tail": "Trace"},
          {"step": "k5", "ok": True, "seconds": 130.0, "result": population},
          {"step": "kernel_variants", "ok": True, "seconds": 30.0, "result": {
              "rows": 100, "length": 32, "heads": 12, "head_dim": 64, "dtype": "bfloat16",
              "step_options": {"num_warps": 4, "num_stages": 1}, "variants": [
                  {"kernel": "backward", "num_warps": 4, "us_per_call": 30.1, "events_per_call": 1.0,
                   "bitwise_equal": True, "max_abs_difference": 0.0},
                  {"kernel": "backward", "num_warps": 2, "us_per_call": 21.04, "events_per_call": 1.0,
                   "bitwise_equal": False, "max_abs_difference": 0.0078125}]}},
          {"step": "ceilings", "ok": True, "seconds": 9.0, "result": {
              "copy_tb_per_s": 2.17, "gemm_square": 8192, "gemm_tflops": 642.5, "chain_kernels": 100,
              "launch_us": 3.0, "threefry_gwords_per_s": 182.0}}]


def test_report_sets_peers_and_phases_beside_each_point_and_returns_five_plain_files(tmp_path):
  rows = _rows()
  raw = tmp_path / "raw"
  raw.mkdir()
  (raw / "b50.hlo.txt.gz").write_bytes(gzip.compress(b"HloModule m"))
  out = tmp_path / "out"
  out.mkdir()
  kit_report.write(str(out), rows, kit.STEPS, str(raw))
  assert sorted(os.listdir(out)) == ["kit.jsonl", "kit.md", "raw.tar.gz", "summary.json", "summary.md"]
  assert all(RETURNED.match(f) and (out / f).is_file() for f in os.listdir(out))  # kit.sh adds kit.log: 6 of 8
  s = json.loads((out / "summary.json").read_text())
  b50, b512, k5 = s["points"]
  assert b50["ratio_torch_eager"] == pytest.approx(7.0) and b50["ratio_torch_compiled"] == pytest.approx(4.0)
  assert b50["ratio_torch_eager_blocked"] == pytest.approx(72.9 / 13.5)
  assert not b512["ok"] and "torch_eager" not in b512 and k5["members"] == 5
  md = (out / "summary.md").read_text()
  assert "# Calibration point: NVIDIA H200, 2026-11-27, commit abc1234" in md
  assert "| bf16 batch 50 | 4 | kernels | 41.0 | 10.00 | 13.50 | 20.0% | 3.00 | 886 | — | — | — |" in md
  assert "| bf16 population K=5, batch 50 | 4 | kernels | 41.0 | 50.00 (10.00 per member) | 55.00 |" in md
  assert s["host"] == "" and "the host's A/B" not in md  # neither b50_k1 nor b50_fixed_graphs ran
  assert "| bf16 batch 50 | 10.00 (13.50) | 70.00 (72.90) | 7.00x (5.40x) | 40.00 (45.00) | 4.00x (3.33x) |" in md
  assert "| b512 | FAILED: RESOURCE_EXHAUSTED: out of memory |" in md
  assert "runs of 20 (10 for the population) calls dispatched back to back" in md and "median of 3 runs" in md
  assert "| encode (backward) | 7.500 | 75.0 | — |" in md and "| matrix multiply | 6.000 | 60.0 | — |" in md
  assert "| `loop_add_fusion_3` | 0.600 | 12 | loop_add_fusion.3, loop_add_fusion.9 (+10) | optimizer |" in md
  assert "copy 2.17 TB/s" in md and "3.00 us each" in md
  assert "| backward | 4 | 30.1 | the step's, bit for bit |" in md
  assert "| backward | 2 | 21.0 | differ by up to 0.00781 |" in md
  text = (out / "kit.md").read_text()
  assert "kit: 9 of 16 steps done, 7 ok, failed: gpu_tests, b512; not run yet: b50_k1, b50_fixed_graphs, " \
         "b512_torch_eager, train, b50_explicit, b50_no_graphs, b512_torch_compiled" in text
  assert text.index("**`gpu_tests` failed: the kit's points train on the explicit path**") < text.index(
      "| step | state |")
  assert "| b512_torch_compiled | not run yet | — (planned 80) |" in text
  assert "- the gate, `pytest -m \"gpu and not trial\"` (tests/x_test.py): **failed**; 3 run, 1 failed" in text
  assert "FAILED tests/x_test.py::test_y" in text
  assert "/root/.cache/huggingface 3 MiB (hub)" in text and md in text


def test_install_merges_two_commands_and_fills_the_prediction(tmp_path, monkeypatch):
  rows = _rows()
  first, second = tmp_path / "call1", tmp_path / "call2"
  for folder, part in ((first, rows[:5]), (second, rows[:1] + rows[5:] + [
      {"step": "b50", "ok": True, "seconds": 61.0, "result": dict(rows[3]["result"], pipelined_step_ms=9.5)}])):
    folder.mkdir()
    raw = tmp_path / f"raw_{folder.name}"
    raw.mkdir()
    (raw / "b50.hlo.txt.gz").write_bytes(gzip.compress(b"HloModule m"))
    kit_report.write(str(folder), part, kit.STEPS, str(raw))
  seen = []

  def fake_predict(text, device, point, trace_path):
    seen.append((text, device, point["batch_size"], os.path.basename(trace_path)))
    return {"predicted_step_ms": 9.5 / 1.25, "floor_ms": 5.0, "predicted_ms_by_phase": {"optimizer": 2.0},
            "predicted_ms_by_kind": None}
  monkeypatch.setattr(kit_report, "predict", fake_predict)
  target = kit_report.install([str(first), str(second)], str(tmp_path / "docs"), None, str(tmp_path / "raw"))
  assert os.path.basename(target) == "h200-2026-11-27-abc1234"
  assert sorted(os.listdir(target)) == ["summary.json", "summary.md"]
  s = json.loads(open(os.path.join(target, "summary.json")).read())
  assert [p["name"] for p in s["points"]] == ["b50", "b512", "k5"]
  assert s["points"][0]["pipelined_step_ms"] == 9.5  # the later command's row wins
  assert seen == [("HloModule m", "NVIDIA H200", 50, "b50.trace.json.gz")]  # the only point whose HLO came back
  md = open(os.path.join(target, "summary.md")).read()
  assert "| 7.60 | 5.00 | 1.25 |" in md and "| optimizer | 2.500 | 25.0 | 2.000 |" in md
  assert sorted(os.listdir(tmp_path / "raw")) == ["b50.hlo.txt.gz"]
  (row,) = [r for r in kit_report.benchmarks_rows(s) if "| bf16 batch 50 |" in r]
  assert row.startswith("| NVIDIA H200 | bf16 batch 50 | 9.50 (13.50) | 20.0% | 7.60 | eager PyTorch 70.00 ms")


def test_predict_times_the_returned_program_on_the_devices_target():
  """A one-kernel program (an f32[1024,256] negate): the prediction is the time model's for the
  device named in the rows (H200: 4.8 TB/s), and nothing for a device the model has no target for."""
  from micse_jax.aot import time_model
  text = ("HloModule m\n\n%fused (p.1: f32[1024,256]) -> f32[1024,256] {\n"
          "  %p.1 = f32[1024,256]{1,0} parameter(0)\n  ROOT %n.1 = f32[1024,256]{1,0} negate(%p.1)\n}\n"
          "ENTRY %main (p: f32[1024,256]) -> f32[1024,256] {\n  %p = f32[1024,256]{1,0} parameter(0)\n"
          "  ROOT %loop_negate_fusion = f32[1024,256]{1,0} fusion(%p), kind=kLoop, calls=%fused\n}\n")
  point = {"dtype": "float32", "batch_size": 50, "max_length": 32, "profile": {"profiled_steps": 1}}
  assert kit_report.predict(text, "cpu", point, None) is None
  predicted = kit_report.predict(text, "NVIDIA H200", point, None)
  device = time_model.DEVICES["h200"]
  memory_s = 2 * 1024 * 256 * 4 / (device.bandwidth * time_model.MEMORY_EFFICIENCY)  # read once, write once
  assert predicted["floor_ms"] == pytest.approx(1e3 * 2 * 1024 * 256 * 4 / device.bandwidth)
  assert predicted["predicted_step_ms"] >= 1e3 * memory_s
  assert "model_check" not in predicted  # no trace came back


# ---------------------------------------------------------------- the plan over two commands

def test_steps_that_do_not_fit_wait_for_the_next_command_and_a_crashed_one_is_not_retried(tmp_path, monkeypatch):
  ran, results = [], {r["step"]: r.get("result") for r in _rows() if r["step"] != "gpu_tests"}

  def fake_measure(k, name):
    ran.append(name)
    if name == "b512":
      raise RuntimeError("simulated failure")
    return results.get(name) or results["b50"] if name in kit_plan.POINTS else results.get(name) or {}
  monkeypatch.setattr(kit, "measure", fake_measure)
  monkeypatch.setattr(kit_report, "setup_facts", lambda: {"device_kind": "NVIDIA H100 80GB HBM3", "date": "d"})
  state, out = tmp_path / "state", tmp_path / "out"
  kit_report_rows = lambda: kit_report.read_rows([str(state / kit_report.ROWS_FILE)])
  kit.main([str(out), "--state", str(state), "--budget_s", "79"])  # 80 s and longer steps do not fit
  assert ran == ["caches", "b50_k1", "b50_fixed_graphs", "kernel_variants", "ceilings", "b50_torch_eager",
                 "b512_torch_eager", "b50_explicit", "b50_no_graphs", "b50_torch_compiled"]
  with open(state / kit_report.ROWS_FILE, "a") as f:  # a process that died inside a step
    f.write(json.dumps({"step": "gpu_tests", "started": True}) + "\n")
  ran.clear()
  kit.main([str(out), "--state", str(state), "--budget_s", "600"])
  assert ran == ["b50", "b512", "train", "k5", "b512_torch_compiled"]  # gpu_tests: died, recorded, not retried
  failed = kit_report.latest(kit_report_rows())["b512"]
  assert not failed["ok"] and "simulated failure" in failed["error"] and "Traceback" in failed["tail"]
  assert "the process died during this step" in kit_report.latest(kit_report_rows())["gpu_tests"]["error"]
  ran.clear()
  kit.main([str(out), "--state", str(state), "--retry", "--steps", "b512,gpu_tests,b50"])
  assert ran == ["b512", "gpu_tests"]
  assert "kit: 16 of 16 steps done, 15 ok, failed: b512\n" in (out / "kit.md").read_text()


@pytest.mark.parametrize("tests_ok", [True, False, None])
def test_the_points_train_with_the_kernels_only_once_gpu_tests_passed(tmp_path, monkeypatch, tests_ok):
  """`gpu_tests` first: passed, b50 / b512 / k5, the host's A/B rows (b50_k1, b50_fixed_graphs),
  b50_no_graphs and the trainer take the kernels the device can run and b50_explicit is the A/B
  without them; failed or not run, every point and the trainer train on the explicit path, each A/B
  row with its own field still set."""
  asked = {}
  monkeypatch.setattr(kit_points, "jax_point", lambda name, *args: asked.setdefault(name, args[-1]) and {})
  monkeypatch.setattr(kit_points, "population_point", lambda name, *args: asked.setdefault(name, args[-1]) and {})
  monkeypatch.setattr(kit_train, "train", lambda state, model, dry, explicit, timeout: asked.setdefault(
      "train", {"model.attention": "explicit"} if explicit else {}) and {})
  monkeypatch.setattr(kit_report, "setup_facts", lambda: {"device_kind": "NVIDIA H100 80GB HBM3", "date": "d"})
  the_kit = kit.Kit(kit.parse_args([str(tmp_path / "out"), "--state", str(tmp_path / "state")]))
  monkeypatch.setattr(kit.Kit, "model_dir", lambda self: "model")
  if tests_ok is not None:
    the_kit.add({"step": "gpu_tests", "ok": tests_ok, "result": {
        "returncode": 1 - tests_ok, "tests": 1, "failures": 1 - tests_ok, "errors": 0, "skipped": 0, "files": [],
        "passed": tests_ok, "tail": ""}})
  for name in ("b50", "b50_k1", "b50_fixed_graphs", "b512", "k5", "b50_explicit", "b50_no_graphs", "train"):
    kit.measure(the_kit, name)
  plain = {} if tests_ok else {"model.attention": "explicit"}
  assert asked == {"b50": plain, "b50_k1": {"steps_per_dispatch": "1", **plain},
                   "b50_fixed_graphs": {"mesh.cuda_graphs": "fixed", **plain}, "b512": plain, "k5": plain,
                   "b50_explicit": {"model.attention": "explicit"},
                   "b50_no_graphs": {"mesh.cuda_graphs": "none", **plain}, "train": plain}


def test_a_new_point_is_one_row_of_the_plan_and_sets_its_config_fields(tmp_path, monkeypatch):
  """A point added to the plan (`kit_plan.POINTS`: batch, fields) runs with its fields at its batch
  (its rehearsal at the tiny batch); the fields land in the trainer's config, and one the config
  lacks stops the point."""
  import ml_collections
  asked = {}
  monkeypatch.setattr(kit_points, "jax_point", lambda name, model, batch, *args: asked.setdefault(
      name, (batch, args[-1])) and {})
  assert "b50_k2" not in kit_plan.POINTS
  monkeypatch.setitem(kit_plan.POINTS, "b50_k2", kit_plan.Point(50, {"steps_per_dispatch": "2"}))
  monkeypatch.setattr(kit_report, "setup_facts", lambda: {"device_kind": "cpu", "date": "d"})
  monkeypatch.setattr(kit.Kit, "model_dir", lambda self: "model")
  for dry in (False, True):
    the_kit = kit.Kit(kit.parse_args([str(tmp_path / f"out{dry}"), "--state", str(tmp_path / f"state{dry}")]
                                     + ["--dry"] * dry))
    the_kit.add({"step": "gpu_tests", "ok": True, "result": {
        "returncode": 0, "tests": 1, "failures": 0, "errors": 0, "skipped": 0, "files": [], "passed": True, "tail": ""}})
    asked.clear()
    kit.measure(the_kit, "b50_k2")
    assert asked == {"b50_k2": (4 if dry else 50, {"steps_per_dispatch": "2"})}
  config = ml_collections.ConfigDict({"steps_per_dispatch": "auto", "mesh": {"cuda_graphs": "auto"}})
  kit_points.set_fields(config, {"steps_per_dispatch": "2", "mesh.cuda_graphs": "fixed"})
  assert config.steps_per_dispatch == "2" and config.mesh.cuda_graphs == "fixed"
  with pytest.raises(KeyError, match="mesh.graph_mode"):
    kit_points.set_fields(config, {"mesh.graph_mode": "xla"})


def test_every_point_of_the_plan_sets_fields_the_trainers_config_accepts():
  """Each JAX point's fields exist in configs/micse.py and pass the trainer's own checks (a field
  or choice renamed in the library would otherwise stop the point only on the lent GPU); the host's
  A/B rows sit beside b50 within the lease, the kernels' and no-graphs rows after it."""
  from micse_jax import config_checks
  from micse_jax.configs import micse
  for name, point in kit_plan.POINTS.items():
    config = micse.get_config()
    kit_points.set_fields(config, point.overrides)
    config_checks.check_fields(config)
  names = [s.name for s in kit_plan.PLAN]
  assert names[names.index("b50"):names.index("b50") + 3] == ["b50", "b50_k1", "b50_fixed_graphs"]
  assert {"b50_k1", "b50_fixed_graphs"} <= set(kit_plan.LEASE_STEPS)
  assert not {"k5", "b50_explicit", "b50_no_graphs"} & set(kit_plan.LEASE_STEPS)
  assert kit_plan.POINTS["b50_k1"].overrides == {"steps_per_dispatch": "1"}
  assert kit_plan.POINTS["b50_fixed_graphs"].overrides == {"mesh.cuda_graphs": "fixed"}


def test_the_report_says_which_path_ran_and_the_kernels_gain(tmp_path):
  rows = _rows()
  rows[2] = {"step": "gpu_tests", "ok": True, "seconds": 90.0, "result": {
      "returncode": 0, "tests": 12, "failures": 0, "errors": 0, "skipped": 0, "files": ["tests/x_test.py"],
      "passed": True, "tail": "", "outcomes": {"test_mask": "passed"}}}
  b50 = rows[3]["result"]
  rows[3]["result"] = dict(b50, attention="fused", own_kernels=True, dropout_kernel_calls=40)
  without_ab = kit_report.summary(rows)["kernels"]  # b50_explicit runs beyond the lease: no gain said
  assert without_ab == ("dropout-attention kernels: `gpu_tests` passed; points with the kernels: b50; on the "
                        "explicit path: k5")
  rows.append({"step": "b50_explicit", "ok": True, "seconds": 50.0, "result": dict(
      b50, pipelined_step_ms=12.5, attention="explicit", own_kernels=True, dropout_kernel_calls=0,
      overrides={"model.attention": "explicit"})})
  s = kit_report.summary(rows)
  assert s["kernels"] == ("dropout-attention kernels: `gpu_tests` passed; points with the kernels: b50; on the "
                          "explicit path: k5, b50_explicit. Batch 50, the same machine: 10.00 ms with the "
                          "kernels, 12.50 ms without: 1.250x (10.00 against 10.00 ms of GPU op time per step)")
  labels = {p["name"]: kit_report.label(p) for p in s["points"]}
  assert labels["b50"] == "bf16 batch 50" and labels["b50_explicit"] == "bf16 batch 50, explicit attention"
  rows[3]["result"] = dict(rows[3]["result"], own_kernels=False, dropout_kernel_calls=0)  # its compile fell back
  s = kit_report.summary(rows)
  assert "points with the kernels: none; on the explicit path: b50, k5, b50_explicit" == s["kernels"].split("; ", 1)[1]


def test_the_report_sets_the_hosts_ab_rows_beside_b50():
  """b50 (auto's steps per call and CUDA graphs) against one step per call (b50_k1) and never-updated
  graphs (b50_fixed_graphs): per training step, pipelined, with each point's K and graphs; a row
  that did not run (or failed) is left out, and without b50 there is no line."""
  rows = _rows()
  b50 = rows[3]["result"] = dict(rows[3]["result"], dispatch_step_ms=0.8)
  k1 = {"step": "b50_k1", "ok": True, "seconds": 60.0, "result": dict(
      b50, steps_per_dispatch=1, pipelined_step_ms=12.0, dispatch_step_ms=3.1, overrides={"steps_per_dispatch": "1"})}
  fixed = {"step": "b50_fixed_graphs", "ok": True, "seconds": 60.0, "result": dict(
      b50, cuda_graphs="fixed", pipelined_step_ms=9.5, dispatch_step_ms=0.5,
      overrides={"mesh.cuda_graphs": "fixed"})}
  s = kit_report.summary(rows + [k1, fixed])
  assert s["host"] == (
      "the host's A/B at batch 50, the same machine, pipelined ms per training step (the host's dispatch in "
      "brackets): b50 (4 steps per call, CUDA graphs kernels) 10.00 (0.80); one step per call (b50_k1: 1 step "
      "per call, CUDA graphs kernels) 12.00 (3.10), 1.200x; CUDA graphs never updated (b50_fixed_graphs: 4 steps "
      "per call, CUDA graphs fixed) 9.50 (0.50), 0.950x")
  md = kit_report.summary_markdown(s)
  assert s["host"] in md
  assert "| bf16 batch 50, one step per call | 1 | kernels | 41.0 | 12.00 |" in md
  assert "| bf16 batch 50, CUDA graphs never updated | 4 | fixed | 41.0 | 9.50 |" in md
  failed = {"step": "b50_fixed_graphs", "ok": False, "seconds": 5.0, "error": "boom"}
  assert "b50_fixed_graphs" not in kit_report.summary(rows + [k1, failed])["host"]
  assert kit_report.summary(rows + [fixed])["host"].endswith(
      "(0.80); CUDA graphs never updated (b50_fixed_graphs: 4 steps per call, CUDA graphs fixed) 9.50 (0.50), 0.950x")
  assert kit_report.summary([r for r in rows if r["step"] != "b50"] + [k1, fixed])["host"] == ""


def test_bad_step_names_are_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    kit.parse_args(["out", "--steps", "b50,b1024"])
  assert e.value.code == 2 and "b1024" in capsys.readouterr().err


# ---------------------------------------------------------------- kernels of a GPU trace

HLO = """HloModule jit_train_step
ENTRY %main {
  %loop_add_fusion.3 = f32[8]{0} fusion(%p), kind=kLoop, metadata={op_name="jit(train_step)/optimizer/add" deduplicated_name="loop_add_fusion.3"}
  %loop_add_fusion.9 = f32[8]{0} fusion(%q), kind=kLoop, metadata={op_name="jit(train_step)/ema/add" deduplicated_name="loop_add_fusion.3"}
  %custom-call.2 = bf16[8,8]{1,0} custom-call(%a, %b), custom_call_target="__cublas$gemm"
  ROOT %tuple = (f32[8]{0}) tuple(%loop_add_fusion.9)
}
"""


def test_kernels_of_a_gpu_trace_are_summed_by_name_with_the_instructions_that_launch_them(tmp_path):
  assert kit_points.instructions_by_kernel(HLO)["loop_add_fusion_9"] == ["loop_add_fusion.3", "loop_add_fusion.9"]
  process = lambda pid, name: {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
  thread = lambda pid, tid, name: {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
  op = lambda pid, tid, name, dur, hlo_op="command_buffer_1": {"ph": "X", "pid": pid, "tid": tid, "name": name,
                                                              "ts": 0, "dur": dur, "args": {"hlo_op": hlo_op}}
  events = [process(1, "/device:GPU:0"), thread(1, 14, "Stream #14(Memset,Compute)"), thread(1, 20, "XLA Ops"),
            process(2, "/host:CPU"), thread(2, 5, "python3"),
            op(2, 5, "loop_add_fusion_3", 999), op(1, 20, "command_buffer_1", 5000)]  # neither a kernel
  for _ in range(2):  # two steps, one kernel launched for two instructions
    events += [op(1, 14, "loop_add_fusion_3", 100), op(1, 14, "loop_add_fusion_3", 60),
               op(1, 14, "nvjet_sm90_tst_128x160_64x5_2x4_h_bz_NTT", 300), op(1, 14, "memset32_post", 2),
               op(1, 14, "nvjet_sm90_tss_64x8_NNT", 40, "custom-call.2")]  # cuBLAS between the graphs
  path = tmp_path / "trace.json.gz"
  path.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
  phases = {"loop_add_fusion.3": "optimizer", "loop_add_fusion.9": "ema", "custom-call.2": "encoder"}
  gemm, add, outside, memset = kit_points.top_kernels(str(path), HLO, phases, steps=2)
  assert gemm == {"kernel": "nvjet_sm90_tst_128x160_64x5_2x4_h_bz_NTT", "ms_per_step": 0.3, "launches_per_step": 1.0,
                  "instructions": [], "instruction_count": 0, "phases": []}  # a library kernel
  assert add == {"kernel": "loop_add_fusion_3", "ms_per_step": pytest.approx(0.16), "launches_per_step": 2.0,
                 "instructions": ["loop_add_fusion.3", "loop_add_fusion.9"], "instruction_count": 2,
                 "phases": ["ema", "optimizer"]}
  assert outside == {"kernel": "nvjet_sm90_tss_64x8_NNT", "ms_per_step": 0.04, "launches_per_step": 1.0,
                     "instructions": ["custom-call.2"], "instruction_count": 1, "phases": ["encoder"]}
  assert memset["kernel"] == "memset32_post" and memset["ms_per_step"] == pytest.approx(0.002)


# ---------------------------------------------------------------- the whole kit, dry

def _check_dry_run(out):
  files = sorted(os.listdir(out))
  assert files == ["kit.jsonl", "kit.log", "kit.md", "raw.tar.gz", "summary.json", "summary.md"], files
  assert all((out / f).stat().st_size < 16 * 2 ** 20 for f in files)
  rows = kit_report.read_rows([str(out / "kit.jsonl")])
  last = kit_report.latest(rows)
  assert [n for n, _ in kit.STEPS if not last[n]["ok"]] == [], {n: last[n].get("error") for n in last}
  tests = last["gpu_tests"]["result"]
  assert tests["tests"] >= 2 and tests["skipped"] == tests["tests"]  # no GPU: every gpu test skips
  s = json.loads((out / "summary.json").read_text())
  points = {p["name"]: p for p in s["points"]}
  assert [(p["name"], p["batch_size"], p["members"]) for p in s["points"]] == [
      ("b50", 4, 1), ("b50_k1", 4, 1), ("b50_fixed_graphs", 4, 1), ("b512", 8, 1), ("k5", 4, 2),
      ("b50_explicit", 4, 1), ("b50_no_graphs", 4, 1)]
  for p in s["points"]:
    assert 0 < p["pipelined_step_ms"] and 0 < p["blocked_step_ms"] and p["compile_s"] > 0
    assert p["profile"]["ms_per_step_by_kind"] and p["profile"]["top_kernels"][0]["instructions"]
    assert p["cuda_graphs"] is None  # CPU: no CUDA graphs, whatever the point asked for
    assert p["steps_per_dispatch"] == 1  # CPU: auto takes one step per call, and b50_k1 asks for it
  assert "the host's A/B at batch 50" in s["host"] and s["host"] in (out / "summary.md").read_text()
  for p in (points["b50"], points["b512"]):  # the points with PyTorch peers
    assert p["ratio_torch_eager"] == pytest.approx(p["torch_eager"]["pipelined_step_ms"] / p["pipelined_step_ms"])
    assert p["torch_compiled"]["pipelined_step_ms"] > 0
  assert s["ceilings"]["copy_tb_per_s"] > 0 and "CPU dry run" in (out / "summary.md").read_text()
  assert s["gate"] == "passed" and tests["trial"]["tests"] >= 2 and tests["others"]["tests"] >= 2
  train = s["train"]  # the real trainer, tiny: its steady step, timeline and ratios to b50
  assert train["ok"] and train["steps_done"] == train["schedule"]["num_train_steps"]
  assert train["steady_ms_per_step"] > 0 and train["timeline"]["train_s"] > 0 and train["timeline"]["save_s"] > 0
  assert train["ratio_to_bench_step"] == pytest.approx(train["steady_ms_per_step"] / points["b50"]["pipelined_step_ms"])
  assert "## The trainer: `python -m micse_jax.main --config configs/micse.py`, 40 steps" in (out / "summary.md").read_text()
  variants = s["kernel_variants"]["variants"]  # the interpreter: warp counts change nothing
  assert len(variants) == 8 and all(v["bitwise_equal"] and v["us_per_call"] > 0 for v in variants)
  names = subprocess.run(["tar", "tzf", str(out / "raw.tar.gz")], capture_output=True, text=True).stdout.split()
  assert sorted(names) == sorted(f"{p}.{k}" for p in points for k in ("hlo.txt.gz", "trace.json.gz"))


@pytest.mark.slow  # about 7 minutes on 2 CPU cores: six compiles, a population, torch.compile twice
def test_kit_runs_to_the_end_in_cpu_dry_mode(tmp_path):
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
  out = tmp_path / "out"
  proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "device", "kit.sh"), str(out), "--dry", "--kit",
                         str(tmp_path / "no_kit"), "--state", str(tmp_path / "state")],
                        env=dict(env, PYTHON=sys.executable), capture_output=True, text=True, timeout=3600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  _check_dry_run(out)


@pytest.mark.slow
def test_kit_runs_in_an_image_like_venv_with_only_the_kits_wheels_added(tmp_path):
  python = os.path.join(IMAGE_VENV, "bin", "python")
  if not os.path.isfile(python):
    pytest.skip(f"no image-like venv at {IMAGE_VENV} (set MICSE_IMAGE_VENV): build it once with "
                "scripts/device/image_venv.sh (needs the package registry)")
  if not os.path.isdir(os.path.join(KIT, "wheels")):
    pytest.skip(f"no kit at {KIT} (set MICSE_KIT_DIR): build it with scripts/device/wheels.sh (needs the registry)")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MICSE_DATA_DIR", "XLA_FLAGS")}
  assert subprocess.run([python, "-c", "import ml_collections"], env=env, capture_output=True).returncode != 0, \
      "the image-like venv must not have what the kit brings"
  out = tmp_path / "out"
  proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "device", "kit.sh"), str(out), "--dry", "--kit", KIT,
                         "--state", str(tmp_path / "state")],
                        env=dict(env, PYTHON=python, MICSE_KIT_SITE=str(tmp_path / "site")),
                        capture_output=True, text=True, timeout=3600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  _check_dry_run(out)
