"""Evaluation figures (accuracy, macro-F1 and per-class recall, from predictions and labels), what
crosses the wire, and the one-line epoch summary printed for people."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

__all__ = ["classification_report", "epoch_summary", "wire_compression"]


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


def wire_compression(optimizer: str, compression: str, comm_state: Any) -> dict[str, str | None]:
    """What crosses the ranks, for the metrics line.

    Args:
        optimizer: ``--optimizer``.
        compression: ``--compression``.
        comm_state: the communication hook's state (``OneBitState`` for the 1-bit schemes); its
            ``payload`` says whether an optimizer exchanges its momentum (``--compression onebit``
            with sgd or adam, and ``--optimizer onebit-adam``) or the hook the gradients.

    Returns:
        ``compression``: the scheme (``none``, ``fp16``, ``onebit`` or ``onebit-momentum``);
        ``compressed``: what was crossing the wire compressed when the epoch ended
        (``gradients`` or ``momentum``), None while nothing is (uncompressed, or a 1-bit
        scheme still in its fp32 warm-up).
    """
    if optimizer == "onebit-adam" or getattr(comm_state, "payload", None) == "momentum":
        return {"compression": "onebit-momentum",
                "compressed": "momentum" if getattr(comm_state, "local_gradients", False) else None}
    if compression == "onebit":
        warm = comm_state.iter >= comm_state.warmup_iters
        return {"compression": "onebit", "compressed": "gradients" if warm else None}
    return {"compression": compression, "compressed": "gradients" if compression != "none" else None}


def epoch_summary(record: dict[str, Any], epochs: int) -> str:
    """One line for people from an epoch's metrics record (``record["epoch"]`` counts from 0,
    the line from 1), e.g. ``epoch 3/10  loss 0.412  val acc 0.873  macro-F1 0.801
    1,234 samples/s  data wait 0.8 %  grad 0.129 B/elem``."""
    share = record.get("data_wait_share")
    wait = "n/a" if share is None else f"{100 * share:.1f} %"
    bpe = record.get("grad_bytes_per_element")
    # Past 1-bit Adam's freeze the bytes are the momentum's; before it, the gradients'.
    what = "momentum" if record.get("compressed") == "momentum" else "grad"
    wire = f"{what} n/a" if bpe is None else f"{what} {bpe:.3f} B/elem"
    return (f"epoch {record['epoch'] + 1}/{epochs}  loss {record['train_loss']:.3f}  "
            f"val acc {record['val_accuracy']:.3f}  macro-F1 {record['val_macro_f1']:.3f}  "
            f"{record['samples_per_s']:,.0f} samples/s  data wait {wait}  {wire}")
