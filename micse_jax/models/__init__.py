"""Flax BERT and its Hugging Face checkpoint loading."""
from micse_jax.models.bert import BertConfig, BertModel, BertOutput, collect_attentions
from micse_jax.models.heads import MLPHead
from micse_jax.models.loading import ModelLoadError, init_params, load_pretrained, resolve_model_dir

__all__ = ["BertConfig", "BertModel", "BertOutput", "collect_attentions", "MLPHead",
           "ModelLoadError", "init_params", "load_pretrained", "resolve_model_dir"]
