"""Command-line options of ``python -m fuelline.trainer`` (launched by torchrun)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn, Sequence

from fuelline.protocol.common.endpoints import parse_host_port
from fuelline.protocol.common.version import version_line

__all__ = ["ONEBIT_SGD_MAX_WORLD", "WARMUP_SHARE", "build_parser", "parse_args", "refusal", "warmup_steps"]

# The share of a run's steps a 1-bit scheme spends uncompressed by default (--freeze-step and
# --warmup-iters auto): the 1-bit Adam paper froze the variance after 15-25 % of training.
WARMUP_SHARE = 0.15

# The most ranks on which 1-bit momentum SGD was measured to keep the accuracy of uncompressed
# momentum SGD (benchmarks/convergence.py: 15 epochs, 3 seeds; on 4 ranks it was ~5 points behind).
ONEBIT_SGD_MAX_WORLD = 2


def refusal(optimizer: str, compression: str, world_size: int, momentum: float = 0.9) -> str | None:
    """Why this combination is refused (it was measured to lose accuracy), and what to use; None
    if it is not. SGD without momentum compresses its gradients, which kept accuracy on 4 ranks."""
    if compression == "onebit" and optimizer == "sgd" and momentum > 0 and world_size > ONEBIT_SGD_MAX_WORLD:
        return (f"--compression onebit --optimizer sgd loses accuracy on more than {ONEBIT_SGD_MAX_WORLD} ranks "
                f"(this job has {world_size}): use --compression onebit --optimizer adam (1-bit Adam), or sgd with "
                "--compression fp16 or none (--accept-accuracy-loss runs it anyway)")
    return None


def _steps_or_auto(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of steps or auto, got {text!r}") from None


def warmup_steps(value: int | str, planned: int | None) -> int:
    """The uncompressed steps of a 1-bit scheme: ``value`` itself, or for ``auto``
    ``WARMUP_SHARE`` of the run's ``planned`` steps (at least 1; 100 when the run's length is
    not known)."""
    if value != "auto":
        return int(value)
    return 100 if not planned else max(1, round(WARMUP_SHARE * planned))


class _Parser(argparse.ArgumentParser):
    """An option error is one line, from rank 0 only: every rank of a torchrun job parses the same
    command line, and a usage text per rank buried the reason in the launcher's report."""

    def error(self, message: str) -> NoReturn:
        if os.environ.get("RANK", "0") == "0":
            self._print_message(f"{self.prog}: error: {message} (--help lists the options)\n", sys.stderr)
        self.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="torchrun --nproc_per_node N -m fuelline.trainer",
                                description="Train a classifier on batches from data servers: the built-in multimodal "
                                            "emotion model, or one of your own (--model).")
    p.add_argument("--version", action="version", version=version_line(), help="print the installed version and exit")
    p.add_argument("--servers", required=True, metavar="HOST:PORT[,HOST:PORT...]",
                   help="the data servers; with several, each serves a disjoint part of every rank's share "
                        "(start them with the same dataset and options)")
    p.add_argument("--connections", type=int, default=1, metavar="N",
                   help="connections to each data server, each a session that serves a disjoint part of the share; "
                        "give a server of --processes N N, so that every one of its processes prepares part of the batches (default: 1)")
    p.add_argument("--epochs", type=int, default=10, help="epochs to train (a resumed run counts the ones done)")
    p.add_argument("--compression", choices=["none", "fp16", "onebit"], default="none",
                   help="what crosses the ranks: fp32 or fp16 gradients, or (onebit) the optimizer's momentum in "
                        "1-bit signs with error feedback: 1-bit momentum SGD with sgd, 1-bit Adam with adam (the "
                        "gradients with sgd and --momentum 0)")
    p.add_argument("--optimizer", choices=["sgd", "adam", "onebit-adam"], default="adam",
                   help="onebit-adam: the same as --compression onebit --optimizer adam")
    p.add_argument("--accept-accuracy-loss", action="store_true",
                   help="run a combination that is refused because it was measured to lose accuracy (to measure it)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.9, help="for sgd")
    p.add_argument("--l2", type=float, default=1e-4, help="λ of the λ‖θ‖₂ term")
    p.add_argument("--weighting", choices=["dwa", "lstm", "none"], default="dwa", help="how α_m(t) is set per epoch")
    p.add_argument("--class-weights", action=argparse.BooleanOptionalAction, default=True,
                   help="weight classes by N_max / (N_c + ε) from the server's class counts")
    p.add_argument("--width", type=int, default=32, help="feature width of the encoders")
    p.add_argument("--model", default=None, metavar="PACKAGE.MODULE:FUNCTION",
                   help="train the nn.Module this function returns for a ModelSpec (fuelline.trainer.model_spec; "
                        "see examples/own_model.py) instead of the built-in multimodal emotion model")
    p.add_argument("--label-source", default=None,
                   help="the source holding each example's class index (default: the label column the dataset "
                        "names, as `fuelline import --label` records it, else label)")
    p.add_argument("--classes", type=int, default=None, metavar="N",
                   help="number of classes, where the server names none (else counted from the train labels)")
    p.add_argument("--warmup-iters", type=_steps_or_auto, default="auto", metavar="STEPS|auto",
                   help="onebit with sgd: steps on fp32-averaged gradients before the momentum is compressed; "
                        "auto: 15 %% of the run's steps (--epochs x batches per epoch)")
    p.add_argument("--freeze-step", type=_steps_or_auto, default="auto", metavar="STEPS|auto",
                   help="onebit with adam: plain Adam steps before the variance freezes and the momentum is "
                        "compressed; auto: 15 %% of the run's steps (--epochs x batches per epoch)")
    p.add_argument("--checkpoint-dir", default=None, help="per-rank checkpoints (model, optimizer, data position)")
    p.add_argument("--checkpoint-every", type=int, default=0, help="also checkpoint every N steps (0: each epoch only)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--max-steps", type=int, default=0,
                   help="stop (after a checkpoint) once this launch made N steps, over every epoch")
    p.add_argument("--metrics-json", default=None, help="append one JSON line per epoch here")
    p.add_argument("--json-stdout", action="store_true",
                   help="print each epoch's JSON line on stdout instead of the one-line summary (which goes to "
                        "stderr then)")
    p.add_argument("--sample-log", default=None, help="per rank, append each step's sample_ids to FILE.rankR")
    p.add_argument("--hwm", type=int, default=10, help="batches each rank prefetches from its data servers")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying a silent data server, or one that refuses connections")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="connect with CURVE: DIR holds client.key_secret and the server's server.key")
    p.add_argument("--seed", type=int, default=0, help="seeds the model's initialisation")
    p.add_argument("--micro-batch", type=int, default=None, help="CUDA: skip the probe and use this micro-batch")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="least severe log records shown")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="log lines for people (text, with a progress bar on a terminal) or one JSON object per "
                        "line for log shippers (json; progress is log records then)")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    args.servers = _servers(p, args.servers)
    _check_numbers(p, args)
    _check_optimizer(p, args)
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")
    if args.model is not None and not re.fullmatch(r"[\w.]+:\w+", args.model):
        p.error(f"--model: {args.model!r} is not package.module:function")
    return args


def _servers(p: argparse.ArgumentParser, text: str) -> list[str]:
    """--servers as a list of HOST:PORT, each named once."""
    servers = [s for s in text.split(",") if s]
    for server in servers:
        try:
            parse_host_port(server, "--servers")
        except ValueError as exc:
            p.error(str(exc))
    if not servers or len(set(servers)) != len(servers):
        p.error(f"--servers: give each data server once, got {text!r}")
    return servers


def _check_numbers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.connections < 1:
        p.error(f"--connections must be >= 1, got {args.connections}")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    if (args.warmup_iters != "auto" and args.warmup_iters < 0) or (args.freeze_step != "auto" and args.freeze_step < 1):
        p.error("--warmup-iters must be >= 0 and --freeze-step >= 1 (the variance needs a gradient)")
    if args.classes is not None and args.classes < 2:
        p.error("--classes must be >= 2")


def _check_optimizer(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The optimizer and compression go together, and lose no accuracy unless the user accepts it."""
    if args.optimizer == "onebit-adam" and args.compression == "fp16":
        p.error("--optimizer onebit-adam compresses the momentum in 1 bit: use --compression onebit --optimizer adam, "
                "or --compression fp16 --optimizer adam")
    try:  # torchrun tells every rank the job's size before it starts
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world_size = 1
    reason = refusal(args.optimizer, args.compression, world_size, args.momentum)
    if reason and not args.accept_accuracy_loss:
        p.error(reason)
