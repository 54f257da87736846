"""`chunk_size`: its config checks (a number against the padded batch and its devices, one line), `auto`'s
choice of the largest block that fits the memory (`training/chunk_choice.py`) and its place in the
program's set-up (`program.build`: resolved once, the program holding the number), the bench's flag."""
import types

import jax
import ml_collections
import pytest

from micse_jax import config_checks
from micse_jax.aot import topology
from micse_jax.errors import ConfigError
from micse_jax.training import chunk_choice


@pytest.mark.parametrize("value", ["auto", "0", "16", 0, 4])
def test_chunk_size_rule_accepts_auto_and_counts(value):
  assert config_checks.RULES["chunk_size"](value) is None


@pytest.mark.parametrize("value", ["-1", "abc", 1.5, -2, "", "4.0", True])
def test_chunk_size_rule_refuses_anything_else(value):
  assert "must be auto or an integer >= 0" in config_checks.RULES["chunk_size"](value)


@pytest.mark.parametrize("value,rows,devices", [("0", 8, 1), ("8", 8, 1), ("4", 8, 1), ("1", 8, 1), ("auto", 8, 1),
                                                ("4", 8, 4), (8, 8, 4), ("2", 12, 2), ("6", 12, 2)])
def test_a_block_that_divides_the_batch_over_its_devices_passes(value, rows, devices):
  config_checks.check_chunk_size(value, rows, devices)


@pytest.mark.parametrize("value,rows,devices,choices", [
    ("3", 8, 1, "0, 1, 2, 4"),      # does not divide 8
    ("16", 8, 1, "0, 1, 2, 4"),     # more rows than the batch
    ("2", 8, 4, "0, 4"),            # 4 devices cut their own rows: a block is a multiple of 4
    ("4", 16, 8, "0, 8"),           # 8 devices: 4 rows would leave half of them without a row
])
def test_a_block_that_does_not_is_one_line_naming_the_choices(value, rows, devices, choices):
  with pytest.raises(ConfigError) as e:
    config_checks.check_chunk_size(value, rows, devices)
  message = str(e.value)
  assert "\n" not in message and f"chunk_size={value}" in message and f"{rows} rows" in message
  assert f"choose one of {choices} (0: the whole batch) or auto" in message


def test_block_sizes_are_the_batch_then_its_divisors_on_the_devices_largest_first():
  assert chunk_choice.block_sizes(12, 1) == [12, 6, 4, 3, 2, 1]
  assert chunk_choice.block_sizes(12, 2) == [12, 6, 4, 2]
  assert chunk_choice.block_sizes(16, 4) == [16, 8, 4]
  assert chunk_choice.block_sizes(5, 1) == [5, 1]


def _peaks(fixed, per_row, whole_extra=0, rows=64):
  """A step's peak of a block size: `fixed` + `per_row` bytes per row of the block, the whole batch's
  `whole_extra` more (its own program); `peak_of` as `choose` takes it, and the sizes it was asked for."""
  asked = []

  def peak_of(size):
    asked.append(size)
    return fixed + per_row * size + (whole_extra if size == rows else 0), fixed
  return peak_of, asked


SIZES = chunk_choice.block_sizes(64, 1)  # 64, 32, 16, 8, 4, 2, 1


@pytest.mark.parametrize("whole_extra", [0, 2_000, -1_500])  # the whole batch's peak on the line, above, below
@pytest.mark.parametrize("limit", [4_200, 4_000, 2_000, 1_500, 1_300, 1_150, 1_060])
def test_choose_takes_the_largest_block_that_fits(limit, whole_extra):
  # blocked peaks 1000 + 50 per row: 32 -> 2600, 16 -> 1800, 8 -> 1400, 4 -> 1200, 2 -> 1100, 1 -> 1050
  peak_of, asked = _peaks(1000, 50, whole_extra)
  size, peak, tried = chunk_choice.choose(SIZES, peak_of, limit)
  expected = next(s for s in SIZES if 1000 + 50 * s + (whole_extra if s == 64 else 0) <= limit)  # by brute force
  assert size == expected and peak == 1000 + 50 * size + (whole_extra if size == 64 else 0)
  assert asked[0] == 64 and len(asked) == len(set(asked)) == len(tried)
  assert SIZES.index(size) == 0 or SIZES[SIZES.index(size) - 1] in tried  # the next larger one was shown not to fit
  assert len(asked) <= 4, asked  # the lines skip the sizes between


def test_choose_says_when_nothing_fits():
  peak_of, asked = _peaks(1000, 50)
  with pytest.raises(LookupError) as e:
    chunk_choice.choose(SIZES, peak_of, 1_000)
  assert e.value.args[0][1] == 1050 and asked[-1] == 1


def test_a_cpu_has_no_limit_so_auto_takes_the_whole_batch_without_compiling(caplog):
  config = ml_collections.ConfigDict({"chunk_size": "auto"})
  compiles = []
  with caplog.at_level("INFO"):
    assert chunk_choice.resolve(config, 8, 1, jax.devices("cpu")[0], compiles.append) == "0"
  assert compiles == [] and "chunk_size=auto" in caplog.text and "whole batch of 8 rows" in caplog.text


def test_a_number_is_kept_as_it_is():
  config = ml_collections.ConfigDict({"chunk_size": 4})
  assert chunk_choice.resolve(config, 8, 1, jax.devices("cpu")[0], None) == "4"


def test_a_deviceless_gpu_gets_its_datasheet_memory_at_jaxs_fraction(monkeypatch):
  monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)

  class Deviceless:
    platform, device_kind = "gpu", "Tesla V100-SXM2-32GB"

    def memory_stats(self):
      raise RuntimeError("MemoryStats is only supported for addressable PjRt devices.")
  tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v5 lite", memory_stats=lambda: None)
  assert chunk_choice.memory_limit(Deviceless())[0] is None  # outside a deviceless compile: none known
  with chunk_choice.deviceless_memory(topology.datasheet_memory):  # as aot/compile.build_program sets it
    limit, source = chunk_choice.memory_limit(Deviceless())
    assert limit == int(0.75 * 16 * 2 ** 30) and source == "75% of the v100 datasheet's 16 GiB"  # the 16 GB V100
    assert chunk_choice.memory_limit(tpu)[0] == 16 * 2 ** 30
  gpu_here = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                   memory_stats=lambda: {"bytes_limit": 12345})
  assert chunk_choice.memory_limit(gpu_here)[0] == 12345


# ------------------------------------------------------------------ in the program's set-up

@pytest.fixture(scope="module")
def tiny(tmp_path_factory, minilm_dir):
  from micse_jax.models.loading import load_config
  from micse_jax.training import program
  from tests.train_utils import tiny_training_config
  config = tiny_training_config(tmp_path_factory.mktemp("chunk_choice"), minilm_dir)
  bert_config = load_config(config.model.name_or_path)
  return config, bert_config, program.abstract_encoder(config, bert_config)


def test_auto_resolves_once_in_the_build_to_the_largest_block_under_a_fake_limit(tiny, monkeypatch, caplog):
  """The peaks of the tries are faked (no compile: `program.compiled` and the compiler's memory replaced):
  8 rows, peaks 100 + 10 per row: a limit of 150 fits blocks of 4 (140), not 8 (180)."""
  from micse_jax.training import program
  config, bert_config, encoder = tiny
  config = config.copy_and_resolve_references()
  config.chunk_size = "auto"
  monkeypatch.setattr(chunk_choice, "memory_limit", lambda device: (150, "a fake limit"))
  monkeypatch.setattr(program, "compiled", lambda prog, run_once=False: prog)
  asked = []

  def memory(executable):
    size = int(asked[-1].config.chunk_size) or 8
    return {"peak": 100 + 10 * size, "arguments": 100, "outputs": 0, "aliased": 0}
  monkeypatch.setattr(chunk_choice, "compiled_memory", memory)
  real_build = program.build

  def build(config, *args, **kwargs):
    prog = real_build(config, *args, **kwargs)
    asked.append(prog)
    return prog
  monkeypatch.setattr(program, "build", build)
  with caplog.at_level("INFO"):
    prog = program.build(config, bert_config, encoder, jax.devices()[:1])
  # the whole batch tried, then the block the line through it says fits; the program returned is the one
  # tried at 4
  assert [p.config.chunk_size for p in asked] == ["0", "4", "4"] and prog is asked[1]
  assert prog.config.chunk_size == "4" and prog.rows == 8
  assert prog.rebuild(prog.target, 1).config.chunk_size == "4"  # a rebuild keeps the number: no second search
  assert "chunk_size=auto: 4 rows per block, peak 0.00 GiB of 0.00 GiB (a fake limit; tried 8 rows" in caplog.text


def test_auto_with_no_block_that_fits_is_one_config_error(tiny, monkeypatch):
  from micse_jax.training import program
  config, bert_config, encoder = tiny
  config = config.copy_and_resolve_references()
  config.chunk_size = "auto"
  monkeypatch.setattr(chunk_choice, "memory_limit", lambda device: (50, "a fake limit"))
  monkeypatch.setattr(program, "compiled", lambda prog, run_once=False: prog)
  monkeypatch.setattr(chunk_choice, "compiled_memory", lambda executable: {"peak": 2 ** 30, "arguments": 2 ** 20, "outputs": 0,
                                                                 "aliased": 0})
  with pytest.raises(ConfigError) as e:
    program.build(config, bert_config, encoder, jax.devices()[:1])
  assert "\n" not in str(e.value) and "chunk_size=auto: no block of the 8-row batch fits" in str(e.value)


def test_the_build_refuses_a_block_that_does_not_divide_the_batch(tiny):
  from micse_jax.training import program
  config, bert_config, encoder = tiny
  config = config.copy_and_resolve_references()
  config.chunk_size = "3"
  with pytest.raises(ConfigError, match="chunk_size=3 must divide the padded global batch of 8 rows"):
    program.build(config, bert_config, encoder, jax.devices()[:1])


# ------------------------------------------------------------------ the bench's flag

@pytest.mark.parametrize("text", ["0", "128", "auto"])
def test_bench_chunk_size_flag_keeps_the_configs_text(text):
  from micse_jax.bench import __main__ as bench
  assert bench.parse_args(["--chunk_size", text]).chunk_size == text
  assert bench.parse_args([]).chunk_size == "0"


@pytest.mark.parametrize("text", ["-1", "x", "1.5"])
def test_bench_chunk_size_flag_refuses_anything_else(text, capsys):
  from micse_jax.bench import __main__ as bench
  with pytest.raises(SystemExit) as e:
    bench.parse_args(["--chunk_size", text])
  assert e.value.code == 2
  assert f"argument --chunk_size: must be auto or an integer >= 0, got '{text}'" in capsys.readouterr().err


def test_the_reports_say_the_chunk_asked_and_run():
  from micse_jax.bench import aot
  assert aot.chunk_line({"chunk_size": "auto", "chunk_size_resolved": 1024, "batch_size": 4096}) == \
      "auto -> 1024 (blocks of 1024 rows)"
  assert aot.chunk_line({"chunk_size": "0", "chunk_size_resolved": 0, "batch_size": 64}) == \
      "0 (the whole batch in one block)"
  assert aot.chunk_line({"chunk_size": "auto", "chunk_size_resolved": 0, "batch_size": 64}) == \
      "auto -> 0 (the whole batch in one block)"
