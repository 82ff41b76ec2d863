"""Evaluation figures: accuracy, macro-F1 and per-class recall, from predictions and labels."""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["classification_report"]


def classification_report(pred: np.ndarray, true: np.ndarray, names: Sequence[str]) -> dict:
    """Accuracy, macro-F1 over the classes present in ``true``, and recall per class (None for a
    class with no example, so an absent class is visible rather than scored 0 or 1)."""
    pred, true = np.asarray(pred), np.asarray(true)
    k = len(names)
    confusion = np.zeros((k, k), dtype=np.int64)
    np.add.at(confusion, (true, pred), 1)
    support = confusion.sum(axis=1)
    predicted = confusion.sum(axis=0)
    tp = np.diag(confusion)
    recall = [float(tp[c] / support[c]) if support[c] else None for c in range(k)]
    f1 = []
    for c in range(k):
        if not support[c]:
            continue
        precision = tp[c] / predicted[c] if predicted[c] else 0.0
        r = tp[c] / support[c]
        f1.append(2 * precision * r / (precision + r) if precision + r else 0.0)
    return {
        "accuracy": float(tp.sum() / max(1, len(true))),
        "macro_f1": float(np.mean(f1)) if f1 else 0.0,
        "recall": dict(zip(names, recall)),
        "support": dict(zip(names, support.tolist())),
    }
