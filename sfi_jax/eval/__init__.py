"""Quality evaluation: a long natural text source, retrieval task generators and the metrics
that compare a sparse decode with a dense one. `scripts/eval_quality.py` runs the evaluation."""

from sfi_jax.eval.metrics import (answer_correct, kl_divergence, log_loss, since_last_slow,
                                  teacher_forced_metrics, top1_agreement)
from sfi_jax.eval.tasks import TASKS, RetrievalSample, make_sample
from sfi_jax.eval.text import TextSource, load_text

__all__ = ["TASKS", "RetrievalSample", "TextSource", "answer_correct", "kl_divergence",
           "load_text", "log_loss", "make_sample", "since_last_slow", "teacher_forced_metrics",
           "top1_agreement"]
