"""The transfer protocol is named where results go (Markdown table, JSON settings) and a bad
`--transfer_protocol` / `eval.transfer_protocol` is one `error:` line."""
import types

import pytest

from micse_jax.evaluation import report


def test_markdown_table_names_the_protocol():
  results = {"transfer": {"tasks": {"MR": {"acc": 71.39}}, "avg": 71.39, "protocol": "senteval"}}
  text = report.markdown_table(results)
  assert text.startswith("Transfer (accuracy, senteval protocol)")
  assert "| 71.39 | - | - | - | - | - | - | 71.39 |" in text


def test_evaluate_rejects_unknown_protocol_in_one_line(tmp_path, capsys):
  from micse_jax.evaluation import command as evaluate
  values = types.SimpleNamespace(
      model=str(tmp_path), senteval_dir=str(tmp_path), tasks="MR", pooler="cls_before_pooler",
      output=str(tmp_path / "out.json"), fast=False, batch_size=8, max_length=16,
      download=False, checkpoint="best", seed=1111, transfer_protocol="sgd")
  with pytest.raises(SystemExit) as e:
    evaluate.evaluate_and_report(values)
  assert e.value.code == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and "--transfer_protocol" in err[0]
  assert not (tmp_path / "out.json").exists()


def test_config_check_rejects_unknown_protocol():
  from micse_jax import config_checks
  from micse_jax.configs import default
  from micse_jax.errors import ConfigError
  config = default.get_config()
  assert config.eval.transfer_protocol == "senteval"
  config.eval.transfer_protocol = "sgd"
  with pytest.raises(ConfigError, match="eval.transfer_protocol"):
    config_checks.check_fields(config)
