"""Bad input across `main`, `evaluate`, `convert` and the bench: one `error:` line, non-zero exit, no
traceback, nothing printed before it, nothing written, an existing workdir untouched; a bad corpus
is found before the model's weights are read.

Most cases call the CLI's own entry function in this process (`main.train`,
`evaluate.evaluate_and_report`, `convert.convert_and_report`: the same code path as the program,
from the flag values on), so that the table stays fast; a few run the real programs as
subprocesses to cover flag parsing and the process exit status end to end.
"""
import hashlib
import json
import os
import re
import shutil
import types

import pytest

from micse_jax import workdir as workdir_lib
from tests.helpers import run_module
from tests.train_utils import tiny_training_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------ fixtures and helpers

@pytest.fixture(scope="module")
def base(tmp_path_factory, minilm_dir):
  """A tiny 2-layer BERT on disk, a 96-sentence corpus, and broken variants of both."""
  root = tmp_path_factory.mktemp("bad_input")
  config = tiny_training_config(root, minilm_dir)
  model = config.model.name_or_path
  paths = {"root": str(root), "model": model, "corpus": config.data.corpus}
  truncated = str(root / "truncated_model")
  shutil.copytree(model, truncated)
  st = os.path.join(truncated, "model.safetensors")
  with open(st, "r+b") as f:
    f.truncate(os.path.getsize(st) // 2)
  mismatch = str(root / "mismatch_model")
  shutil.copytree(model, mismatch)
  cfg_path = os.path.join(mismatch, "config.json")
  cfg = json.loads(open(cfg_path, encoding="utf-8").read())
  cfg["hidden_size"] = 32  # weights are hidden 64
  with open(cfg_path, "w", encoding="utf-8") as f:
    json.dump(cfg, f)
  os.makedirs(root / "empty_model")
  corpora = root / "corpora"
  corpora.mkdir()
  (corpora / "empty.txt").write_bytes(b"")
  (corpora / "binary.bin").write_bytes(bytes(range(256)) * 64)
  (corpora / "blank.txt").write_bytes(b"\n  \n\t\n")
  (corpora / "a_directory").mkdir()
  (corpora / "huge_line.txt").write_text("word " * 200_000 + "\n", encoding="utf-8")
  (corpora / "few.txt").write_text("one sentence\nanother one\nthree\n", encoding="utf-8")
  paths.update(truncated=truncated, mismatch=mismatch, empty_model=str(root / "empty_model"),
               corpora=str(corpora))
  return paths


def _snapshot(root: str) -> dict:
  """Every file and folder under `root` with a content hash: 'unchanged' means equal snapshots."""
  snap = {}
  for folder, dirs, files in os.walk(root):
    for d in dirs:
      snap[os.path.relpath(os.path.join(folder, d), root) + "/"] = None
    for f in files:
      with open(os.path.join(folder, f), "rb") as fh:
        snap[os.path.relpath(os.path.join(folder, f), root)] = hashlib.sha256(fh.read()).hexdigest()
  return snap


def _existing_workdir(tmp_path) -> str:
  wd = tmp_path / "wd"
  wd.mkdir()
  (wd / "notes.txt").write_text("a workdir the user already has\n", encoding="utf-8")
  return str(wd)


_PROGRESS_BAR = re.compile(r"^[\w ]+:\s+\d+%\|")  # tqdm's "tokenizing:  40%|####  | ..."


def _assert_one_line(err: str, *fragments):
  """Exactly one non-empty line besides progress-bar updates: the `error:` line."""
  lines = [line for line in err.replace("\r", "\n").splitlines()
           if line.strip() and not _PROGRESS_BAR.match(line)]
  assert len(lines) == 1, err
  assert lines[0].startswith("error: ") and "Traceback" not in err, err
  for fragment in fragments:
    assert fragment in lines[0], lines[0]


def _exits_with_one_line(capsys, call, *fragments, status=1):
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    call()
  assert e.value.code == status
  captured = capsys.readouterr()
  _assert_one_line(captured.err, *fragments)
  assert captured.out == "", captured.out  # nothing before the error line (no "compute dtype: ...")


# ------------------------------------------------------------------ main (training)

def _config(base, minilm_dir, **changes):
  """The tiny training config (model and corpus of `base`) with dotted-key changes."""
  import pathlib
  return tiny_training_config(pathlib.Path(base["root"]), minilm_dir, **changes)


def _write_stsb(root, dev_lines=None, with_train=True):
  """A SentEval folder holding only STS-B (3 pairs per split); `dev_lines` replaces dev."""
  folder = os.path.join(root, "STS", "STSBenchmark")
  os.makedirs(folder, exist_ok=True)
  good = [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{i}.0\ta man plays {i}\ta man sings {i}\n"
          for i in range(3)]
  for split in ("train", "dev", "test"):
    if split == "train" and not with_train:
      continue
    with open(os.path.join(folder, f"sts-{split}.csv"), "w", encoding="utf-8") as f:
      f.writelines(dev_lines if split == "dev" and dev_lines is not None else good)
  return root


MAIN_CASES = {  # name: (config changes as a function of the fixture paths, expected fragments)
    "corpus_empty": (lambda b: {"data.corpus": f"{b['corpora']}/empty.txt"}, ["empty"]),
    "corpus_binary": (lambda b: {"data.corpus": f"{b['corpora']}/binary.bin"}, ["UTF-8"]),
    "corpus_blank_lines": (lambda b: {"data.corpus": f"{b['corpora']}/blank.txt"}, ["blank"]),
    "corpus_directory": (lambda b: {"data.corpus": f"{b['corpora']}/a_directory"}, ["directory"]),
    "corpus_one_huge_line": (lambda b: {"data.corpus": f"{b['corpora']}/huge_line.txt"}, ["huge_line"]),
    "corpus_fewer_than_batch": (lambda b: {"data.corpus": f"{b['corpora']}/few.txt"}, ["few.txt"]),
    "corpus_checked_before_the_model_loads": (  # the weights are unreadable too: the corpus is found first
        lambda b: {"data.corpus": f"{b['corpora']}/empty.txt", "model.name_or_path": b["truncated"]}, ["empty"]),
    "model_missing": (lambda b: {"model.name_or_path": f"{b['root']}/no_such_model"}, ["does not exist"]),
    "model_empty": (lambda b: {"model.name_or_path": b["empty_model"]}, ["no config.json"]),
    "model_truncated_safetensors": (lambda b: {"model.name_or_path": b["truncated"]}, ["safetensors"]),
    "model_config_mismatches_weights": (lambda b: {"model.name_or_path": b["mismatch"]},
                                        ["shape mismatch"]),
    "value_learning_rate": (lambda b: {"optim.learning_rate": -1.0}, ["optim.learning_rate", "> 0"]),
    "value_ami_weight_nan": (lambda b: {"ami.weight": float("nan")}, ["ami.weight", "finite"]),
    "value_temperature_zero": (lambda b: {"loss.temperature": 0.0}, ["loss.temperature"]),
    "value_dropout_one": (lambda b: {"momentum.dropout": 1.0}, ["momentum.dropout"]),
    "value_eval_every_negative": (lambda b: {"eval_every": -1}, ["eval_every"]),
    "value_ami_layers_out_of_range": (lambda b: {"ami.layers": (0, 9)}, ["ami.layers", "2-layer"]),
    "value_chunk_size_negative": (lambda b: {"chunk_size": "-8"}, ["chunk_size", "auto or an integer >= 0"]),
    "value_chunk_size_not_dividing_the_batch": (lambda b: {"chunk_size": "3"},
                                                ["chunk_size=3 must divide the padded global batch of 8 rows"]),
    "value_unknown_final_task": (lambda b: {"eval.final_tasks": "STS99"}, ["eval.final_tasks", "STS99"]),
    "senteval_dir_missing": (lambda b: {"eval_every": 2, "eval.senteval_dir": f"{b['root']}/nope"},
                             ["eval.senteval_dir", "nope"]),
    "senteval_dir_malformed": (
        lambda b: {"eval_every": 2, "eval.senteval_dir": _write_stsb(
            f"{b['root']}/senteval_bad", dev_lines=["only\tthree\tcolumns\n"])},
        ["sts-dev.csv:1"]),
    "senteval_dir_incomplete": (
        lambda b: {"eval_every": 2, "eval.senteval_dir": _write_stsb(
            f"{b['root']}/senteval_incomplete", with_train=False)},
        ["sts-train.csv", "not found"]),
}


@pytest.mark.parametrize("case", sorted(MAIN_CASES))
def test_main_bad_input(case, base, minilm_dir, tmp_path, capsys):
  from micse_jax import main
  changes, fragments = MAIN_CASES[case]
  config = _config(base, minilm_dir, **changes(base))
  workdir = _existing_workdir(tmp_path)
  before = _snapshot(workdir)
  _exits_with_one_line(capsys, lambda: main.train(config, workdir), *fragments)
  assert _snapshot(workdir) == before


def test_main_auto_chunk_size_with_no_block_that_fits(base, minilm_dir, tmp_path, capsys, monkeypatch):
  """`chunk_size=auto` where even one-row blocks exceed the memory (the limit and the compiler's peaks
  faked: no compile): one line, before the workdir is touched (its checkpoint folder included)."""
  from micse_jax import main
  from micse_jax.training import chunk_choice, program
  monkeypatch.setattr(chunk_choice, "memory_limit", lambda device: (2 ** 20, "a fake 1 MiB"))
  monkeypatch.setattr(program, "compiled", lambda prog, run_once=False: prog)
  monkeypatch.setattr(chunk_choice, "compiled_memory", lambda executable: {"peak": 2 ** 30, "arguments": 2 ** 29,
                                                                           "outputs": 0, "aliased": 0})
  config = _config(base, minilm_dir, chunk_size="auto")
  workdir = _existing_workdir(tmp_path)
  before = _snapshot(workdir)
  _exits_with_one_line(capsys, lambda: main.train(config, workdir), "chunk_size=auto: no block of the 8-row batch "
                       "fits the memory (0.00 GiB, a fake 1 MiB): even blocks of 1 row(s) peak at 1.00 GiB")
  assert _snapshot(workdir) == before


def test_main_workdir_is_a_file(base, minilm_dir, tmp_path, capsys):
  from micse_jax import main
  path = tmp_path / "a_file"
  path.write_text("not a folder\n", encoding="utf-8")
  _exits_with_one_line(capsys, lambda: main.train(_config(base, minilm_dir), str(path)),
                       "not a directory")
  _exits_with_one_line(capsys, lambda: main.train(_config(base, minilm_dir), str(path / "sub")),
                       "not writable")
  assert path.read_text(encoding="utf-8") == "not a folder\n"


def _fake_run(workdir: str, config) -> None:
  """A workdir as a previous run leaves it: config.json and a step folder."""
  workdir_lib.write_run_config(workdir, {**config.to_dict(), "model_dir": "m", "bert_config": {}})
  step = os.path.join(workdir, workdir_lib.ROLLING_DIR, "2")
  os.makedirs(step)
  with open(os.path.join(step, "payload"), "wb") as f:
    f.write(b"\x00garbage, not an Orbax checkpoint\xff" * 8)


def test_main_resume_with_a_different_run_config(base, minilm_dir, tmp_path, capsys):
  from micse_jax import main
  workdir = _existing_workdir(tmp_path)
  _fake_run(workdir, _config(base, minilm_dir))
  before = _snapshot(workdir)
  changed = _config(base, minilm_dir, batch_size=12, **{"loss.temperature": 0.1})
  _exits_with_one_line(capsys, lambda: main.train(changed, workdir),
                       "batch_size (8 -> 12)", "loss.temperature (0.05 -> 0.1)", "new --workdir")
  assert _snapshot(workdir) == before


def test_main_corrupted_checkpoint(base, minilm_dir, tmp_path, capsys):
  from micse_jax import main
  workdir = _existing_workdir(tmp_path)
  config = _config(base, minilm_dir)
  _fake_run(workdir, config)
  before = _snapshot(workdir)
  _exits_with_one_line(capsys, lambda: main.train(config, workdir), "checkpoint")
  assert _snapshot(workdir) == before


# ------------------------------------------------------------------ evaluate

def _tiny_sts13(root, broken=False, incomplete=False):
  folder = os.path.join(root, "STS", "STS13-en-test")
  os.makedirs(folder, exist_ok=True)
  for subset in ("FNWN", "headlines", "OnWN"):
    with open(os.path.join(folder, f"STS.input.{subset}.txt"), "w", encoding="utf-8") as f:
      f.write("a man plays\tthe man plays\n" + ("no tab here\n" if broken else "a dog\tcats\n"))
    if not (incomplete and subset == "OnWN"):
      with open(os.path.join(folder, f"STS.gs.{subset}.txt"), "w", encoding="utf-8") as f:
        f.write("4.5\n0.5\n")
  return root


def _eval_values(base, tmp_path, **changes):
  values = dict(model=base["model"], senteval_dir=_tiny_sts13(str(tmp_path / "senteval")),
                tasks="STS13", pooler="cls_before_pooler", output=str(tmp_path / "out.json"),
                fast=True, batch_size=8, max_length=16, download=False, checkpoint="best", seed=1111)
  values.update(changes)
  return types.SimpleNamespace(**values)


EVALUATE_CASES = {
    "senteval_malformed": (lambda b, t: {"senteval_dir": _tiny_sts13(str(t / "bad"), broken=True)},
                           ["STS.input.FNWN.txt:2"]),
    "senteval_incomplete": (lambda b, t: {"senteval_dir": _tiny_sts13(str(t / "inc"), incomplete=True)},
                            ["STS.gs.OnWN.txt", "not found"]),
    "model_missing": (lambda b, t: {"model": str(t / "no_model")}, ["model path not found"]),
    "model_truncated_safetensors": (lambda b, t: {"model": b["truncated"]}, ["safetensors"]),
    "unknown_task": (lambda b, t: {"tasks": "STS13,STS17"}, ["STS17"]),
}


@pytest.mark.parametrize("case", sorted(EVALUATE_CASES))
def test_evaluate_bad_input(case, base, tmp_path, capsys):
  from micse_jax.evaluation import command as evaluate
  changes, fragments = EVALUATE_CASES[case]
  values = _eval_values(base, tmp_path, **changes(base, tmp_path))
  _exits_with_one_line(capsys, lambda: evaluate.evaluate_and_report(values), *fragments)
  assert not os.path.exists(values.output)


# ------------------------------------------------------------------ convert

def test_convert_export_target_exists(base, tmp_path, capsys):
  from micse_jax import convert
  out = tmp_path / "export"
  out.mkdir()
  (out / "keep.txt").write_text("mine\n", encoding="utf-8")
  before = _snapshot(str(out))
  _exits_with_one_line(capsys, lambda: convert.convert_and_report(model=base["model"], output=str(out)),
                       "not empty", "--overwrite")
  assert _snapshot(str(out)) == before


def test_convert_workdir_without_checkpoint(base, tmp_path, capsys):
  from micse_jax import convert
  workdir = _existing_workdir(tmp_path)
  workdir_lib.write_run_config(workdir, {"model_dir": base["model"], "bert_config": {}})
  os.makedirs(os.path.join(workdir, workdir_lib.ROLLING_DIR))
  before = _snapshot(workdir)
  out = tmp_path / "export"
  _exits_with_one_line(capsys, lambda: convert.convert_and_report(workdir=workdir, output=str(out)),
                       "no rolling checkpoint")
  _exits_with_one_line(capsys, lambda: convert.convert_and_report(workdir=workdir, best=True, step=3,
                                                                  output=str(out)),
                       "mutually exclusive")
  assert not out.exists() and _snapshot(workdir) == before


def test_convert_truncated_checkpoint(base, tmp_path, capsys):
  import orbax.checkpoint as ocp

  from micse_jax import convert
  from micse_jax.models.loading import load_pretrained
  workdir = _existing_workdir(tmp_path)
  _, params, bert_config, _ = load_pretrained(base["model"])
  workdir_lib.write_run_config(workdir, {"model_dir": base["model"], "bert_config": bert_config.to_dict()})
  manager = workdir_lib.rolling_manager(workdir, keep=2)
  manager.save(3, args=ocp.args.PyTreeSave({"params": {"encoder": params, "head": {}}}))
  manager.wait_until_finished()
  for folder, _, files in os.walk(os.path.join(workdir, workdir_lib.ROLLING_DIR, "3")):
    for name in files:  # truncate every array/metadata file of the only checkpoint
      path = os.path.join(folder, name)
      with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 3)
  before = _snapshot(workdir)
  out = tmp_path / "export"
  _exits_with_one_line(capsys, lambda: convert.convert_and_report(workdir=workdir, output=str(out)),
                       "checkpoint")
  assert not out.exists() and _snapshot(workdir) == before


# ------------------------------------------------------------------ the real programs

@pytest.mark.parametrize("override,status,fragments", [
    ("--config.batch_sise=3", 2, ["unknown field 'batch_sise'", "batch_size"]),   # bad key
    ("--config.batch_size=abc", 2, ["--config.batch_size=abc"]),                 # bad type
    ("--config.data.corpus=/nonexistent/corpus.txt", 1, ["corpus file not found"]),  # bad file
])
def test_mainrun_module(override, status, fragments, base, tmp_path):
  workdir = _existing_workdir(tmp_path)
  before = _snapshot(workdir)
  proc = run_module("micse_jax.main", "--config", "configs/micse.py", "--workdir", workdir,
                  f"--config.model.name_or_path={base['model']}", "--config.eval_every=0",
                  "--config.eval.final_tasks=", "--config.ami.layers=(0,1)", override)
  assert proc.returncode == status, proc.stderr
  _assert_one_line(proc.stderr, *fragments)
  assert proc.stdout == "" and _snapshot(workdir) == before


def test_convert_program_workdir_without_checkpoint(base, tmp_path):
  workdir = _existing_workdir(tmp_path)
  workdir_lib.write_run_config(workdir, {"model_dir": base["model"], "bert_config": {}})
  os.makedirs(os.path.join(workdir, workdir_lib.ROLLING_DIR))
  out = tmp_path / "export"
  proc = run_module("micse_jax.convert", "--workdir", workdir, "--output", str(out))
  assert proc.returncode == 1, proc.stderr
  _assert_one_line(proc.stderr, "no rolling checkpoint")
  assert not out.exists()


# ------------------------------------------------------------------ the bench (argparse)

@pytest.mark.parametrize("argv,status,fragment", [
    (["--aot", "bogus"], 2, "argument --aot: invalid choice: 'bogus'"),
    (["--devices", "0"], 2, "--devices must be >= 1"),
    (["--batch_size", "-5"], 2, "--batch_size"),
    (["--batch_size", "x"], 2, "argument --batch_size: invalid int value: 'x'"),
    (["--population", "-1", "--aot", "h100"], 2, "argument --population: must be an integer >= 1, got '-1'"),
    (["--population", "0", "--aot", "h100"], 2, "argument --population: must be an integer >= 1, got '0'"),  # was no population
    (["--population", "2"], 2, "--population K (K >= 1) goes with --aot"),
    # the trainer's length check, before anything is compiled (an --aot compile used to fail in XLA after
    # a spurious kernel fallback) or written (--output, --rows)
    (["--aot", "h100", "--model", "tiny", "--batch_size", "8", "--max_length", "1000"], 1,
     "--model tiny --max_length 1000: model.max_length 1000 exceeds the 512 positions the model has"),
    (["--model", "tiny", "--max_length", "513", "--no_torch"], 1, "exceeds the 512 positions"),
    (["--chunk_size", "-4"], 2, "argument --chunk_size: must be auto or an integer >= 0, got '-4'"),
    (["--model", "tiny", "--batch_size", "8", "--chunk_size", "3", "--no_torch"], 1,
     "chunk_size=3 must divide the padded global batch of 8 rows")])
def test_bench_bad_input_is_one_error_line(argv, status, fragment, tmp_path, capsys):
  from micse_jax.bench import __main__ as bench
  written = [str(tmp_path / "out.json"), str(tmp_path / "rows.jsonl")]
  with pytest.raises(SystemExit) as e:
    bench.entry(argv + ["--output", written[0], "--rows", written[1]])
  out, err = capsys.readouterr()
  assert e.value.code == status and out == ""
  _assert_one_line(err, fragment)
  assert not any(os.path.exists(p) for p in written)


def test_bench_help_prints_the_usage_and_exits_0(capsys):
  from micse_jax.bench import __main__ as bench
  with pytest.raises(SystemExit) as e:
    bench.entry(["--help"])
  assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m micse_jax.bench")
