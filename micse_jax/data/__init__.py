"""Training data: corpus reading/validation, few-shot subsets, the batch pipeline."""
from micse_jax.data.corpus import CorpusError, first_occurrence_ids, read_corpus, select_subset, subset_indices
from micse_jax.data.pipeline import (
                                     DEFAULT_MAX_LENGTH,
                                     ROW_MASK_KEY,
                                     SENTENCE_IDS_KEY,
                                     TOKEN_KEYS,
                                     TrainBatches,
                                     build_train_batches,
                                     tokenize_corpus,
)

__all__ = [
    "CorpusError", "first_occurrence_ids", "read_corpus", "select_subset", "subset_indices", "DEFAULT_MAX_LENGTH",
    "ROW_MASK_KEY", "SENTENCE_IDS_KEY", "TOKEN_KEYS", "TrainBatches", "build_train_batches", "tokenize_corpus",
]
