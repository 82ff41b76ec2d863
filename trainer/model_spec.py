"""Bringing a model of one's own to the trainer: ``--model package.module:function``.

The function is called once per rank with a :class:`ModelSpec` (what the data server's Welcome
says, plus the trainer options a model may use) and returns an ``nn.Module``. Its ``forward``
takes the batch as a dict of tensors (every source but the label, ``sample_id`` and ``t_start``)
and returns logits ``[B, classes]``, or a dict of logits per head. With several heads, one must be
``"fused"``: it is the one evaluated, and every head has a loss of its own, weighted per epoch
(``--weighting``). See ``examples/own_model.py``.

Without ``--model`` the built-in multimodal emotion model is trained; data it cannot train is
refused with a :class:`~fuelline.protocol.DataError` that says what is missing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError
from fuelline.protocol.common.callables import load_callable
from fuelline.trainer.model import MODALITIES, EmotionNet

__all__ = ["ModelSpec", "SINGLE_HEAD", "EVAL_HEAD", "load_factory", "require_builtin", "builtin_model", "build_model",
           "heads_of", "as_heads", "count_classes", "scan_classes", "class_facts"]

log = logging.getLogger("fuelline.trainer")

# The name a model's single (not per-head) output goes by in losses and metrics.
SINGLE_HEAD = "output"
# With several heads, the one evaluated.
EVAL_HEAD = "fused"
BRING_YOUR_OWN = "bring a model with --model package.module:function (see examples/own_model.py)"


@dataclass(frozen=True)
class ModelSpec:
    """What a model factory is given to build its model.

    Attributes:
        sources: every source the server sends, in its order (``sample_id``, ``t_start`` and
            the label included; the model's forward is not given those three).
        schema: per source ``{"dtype": numpy dtype name, "shape": [per-example shape, no batch axis]}``.
        classes: how many classes the logits must have (``[B, classes]``).
        class_names: the classes' names if the server knows them, else None.
        label_source: the source holding the class index of each example (``--label-source``).
        width: the trainer's ``--width``, a suggested feature width.
        seed: the trainer's ``--seed``; torch is already seeded with it on every rank.
        info: everything else the server says about the train split (rows, batch size...).
    """

    sources: tuple[str, ...]
    schema: Mapping[str, Mapping[str, Any]]
    classes: int
    class_names: tuple[str, ...] | None
    label_source: str
    width: int
    seed: int
    info: Mapping[str, Any]

    def __post_init__(self) -> None:
        if self.classes < 2:
            raise ValueError(f"a classifier needs at least 2 classes, got {self.classes}")
        if self.class_names is not None and len(self.class_names) != self.classes:
            raise ValueError(f"{len(self.class_names)} class names for {self.classes} classes")
        if self.label_source not in self.schema:
            raise ValueError(f"label source {self.label_source!r} is not one of the sources {list(self.schema)}")
        # Read-only views: a factory must not change what the next one (or the trainer) sees.
        object.__setattr__(self, "schema", MappingProxyType({k: MappingProxyType(dict(v)) for k, v in self.schema.items()}))
        object.__setattr__(self, "info", MappingProxyType(dict(self.info)))

    @property
    def inputs(self) -> tuple[str, ...]:
        """The sources the model's forward is given."""
        return tuple(s for s in self.sources if s not in (self.label_source, "sample_id", "t_start"))


def load_factory(spec: str) -> Callable[[ModelSpec], nn.Module]:
    """Import ``package.module:function`` (the value of ``--model``)."""
    return load_callable(spec, "--model", "examples.own_model:build")


def require_builtin(sources: tuple[str, ...], info: Mapping[str, Any]) -> None:
    """Raise a DataError that says what is missing if the built-in emotion model cannot train this data."""
    what = []
    if "emotions" not in info:
        what.append("the server names no emotions (not a converted multimodal dataset)")
    missing = [m for m in MODALITIES if m not in sources]
    if missing:
        what.append(f"sources {missing} are missing (it serves {list(sources)})")
    if what:
        raise DataError(f"the built-in emotion model cannot train this data: {'; '.join(what)}; {BRING_YOUR_OWN}")


def builtin_model(spec: ModelSpec) -> nn.Module:
    """The built-in emotion model (the default ``--model``)."""
    require_builtin(spec.sources, spec.info)
    return EmotionNet(spec.schema, spec.classes, width=spec.width)


def build_model(args: Any, sources: tuple[str, ...], schema: Mapping[str, Any], info: Mapping[str, Any],
                scan: Callable[[], int], device: torch.device) -> tuple[nn.Module, ModelSpec, list[str], list[int] | None]:
    """The model ``args.model`` names (the built-in one without it) on ``device``, the spec it was
    built from, its head names and the train examples per class (None if the server gives none).
    ``scan`` counts the classes from the train labels, for when neither the server nor ``--classes`` does."""
    factory: Callable[[ModelSpec], nn.Module]
    if args.model is None:
        require_builtin(tuple(sources), info)  # before any pass over the data
        factory, name = builtin_model, "built-in"
    else:
        factory, name = load_factory(args.model), args.model
    if args.label_source not in sources:
        raise DataError(f"--label-source {args.label_source!r}: the server serves no such source (it serves {list(sources)})")
    names, classes, counts = class_facts(info, args.classes, scan, args.label_source)
    if classes < 2:
        raise DataError(f"{classes} class(es) in label source {args.label_source!r}: a classifier needs at least 2")
    spec = ModelSpec(sources=tuple(sources), schema=schema, classes=classes, class_names=names,
                     label_source=args.label_source, width=args.width, seed=args.seed, info=info)
    model = factory(spec)
    if not isinstance(model, nn.Module):
        raise DataError(f"--model {name}: returned {type(model).__name__}, not a torch.nn.Module")
    model = model.to(device)
    return model, spec, heads_of(model, spec, device, name), counts


def as_heads(out: Any) -> dict[str, torch.Tensor]:
    """A model's output as logits per head (a single tensor is the head ``SINGLE_HEAD``)."""
    if isinstance(out, torch.Tensor):
        return {SINGLE_HEAD: out}
    if isinstance(out, Mapping) and out and all(isinstance(v, torch.Tensor) for v in out.values()):
        return dict(out)
    raise DataError(f"the model returned {type(out).__name__}: expected logits [B, classes] or a dict of them per head")


def heads_of(model: nn.Module, spec: ModelSpec, device: torch.device, name: str) -> list[str]:
    """Run ``model`` once on a zero batch of two examples (eval mode, no gradient), check its
    logits' shapes and return its head names, so that a mismatch is caught before training, by name."""
    batch = {}
    for source in spec.inputs:
        dtype, shape = spec.schema[source].get("dtype"), spec.schema[source].get("shape")
        if dtype is None or shape is None:
            raise DataError(f"source {source!r} has no fixed dtype and shape in the server's schema; the trainer needs them")
        batch[source] = torch.from_numpy(np.zeros((2, *shape), dtype=np.dtype(dtype))).to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            heads = as_heads(model(batch))
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"model {name}: its forward failed on a batch of sources {list(batch)}: "
                        f"{type(exc).__name__}: {exc}") from exc
    finally:
        model.train(was_training)
    for head, z in heads.items():
        if tuple(z.shape) != (2, spec.classes):
            raise DataError(f"model {name}: head {head!r} gives logits of shape {list(z.shape)} for 2 examples, "
                            f"expected [2, {spec.classes}] ({spec.classes} classes)")
    if len(heads) > 1 and EVAL_HEAD not in heads:
        raise DataError(f"model {name}: with several heads ({list(heads)}) one must be {EVAL_HEAD!r}, the one evaluated")
    return list(heads)


def count_classes(labels: Iterable[torch.Tensor], source: str, device: torch.device) -> int:
    """The number of classes, from the largest label in ``labels`` (this rank's share of the
    train split) and, under torchrun, every other rank's."""
    top = -1
    for y in labels:
        if y.numel():
            if int(y.min()) < 0:
                raise DataError(f"label source {source!r} holds a negative class index ({int(y.min())})")
            top = max(top, int(y.max()))
    if dist.is_initialized():
        t = torch.tensor([top], dtype=torch.int64, device=device)  # NCCL reduces only CUDA tensors
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        top = int(t.item())
    return top + 1


def scan_classes(stream_options: Mapping[str, Any], source: str, device: torch.device) -> int:
    """:func:`count_classes` over this rank's share of the train labels, read on a stream of
    their own (``stream_options``: the trainer's ``ServerDataStream`` keywords)."""
    with ServerDataStream([source], split="train", **stream_options) as labels:
        return count_classes((b[source] for b in labels.get_epoch_iterator(as_dict=True)), source, device)


def class_facts(info: Mapping[str, Any], classes: int | None, scan: Callable[[], int],
                label_source: str | None = None) -> tuple[tuple[str, ...] | None, int, list[int] | None]:
    """Class names (None if the server knows none), the number of classes, and train examples per
    class (None if the server gives no counts). The count comes from the server's names (a
    multimodal dataset's emotions; the classes ``fuelline import`` recorded for the label column,
    when that is ``label_source``), else ``--classes``, else ``scan()`` (a pass over the train
    labels)."""
    names = tuple(info["emotions"]) if "emotions" in info else None
    if names is None and "class_names" in info and info.get("label") == label_source:
        names = tuple(info["class_names"])
    if names is not None:
        if classes is not None and classes != len(names):
            raise DataError(f"--classes {classes}: the server names {len(names)} classes {list(names)}")
        classes = len(names)
    elif classes is None:
        classes = scan()
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("the server names no classes: %d counted from the train labels "
                     "(give --classes to skip that pass)", classes)
    counts = info.get("class_counts")
    if names is not None and isinstance(counts, Mapping) and all(n in counts for n in names):
        return names, classes, [int(counts[n]) for n in names]
    return names, classes, None
