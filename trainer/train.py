"""The DDP training loop: data from a fuelline server, weighted multimodal losses, compressed
gradients, per-epoch evaluation and metrics, checkpoints that resume the same sample sequence."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from fuelline.client import ServerDataStream
from fuelline.protocol import DataError
from fuelline.trainer import comm
from fuelline.trainer.checkpoint import CheckpointError, Checkpoints
from fuelline.trainer.cli import parse_args, warmup_steps
from fuelline.trainer.dynamic_batch import MicroBatcher
from fuelline.trainer.finite import NonFiniteError, check_finite
from fuelline.trainer.lifecycle import exit_with_parent, shutdown
from fuelline.trainer.losses import class_weights, l2_norm, loss_sum, make_weighting, modality_losses
from fuelline.trainer.model_spec import EVAL_HEAD, as_heads, build_model, scan_classes
from fuelline.trainer.onebit_momentum import register_momentum_hook
from fuelline.trainer.optimizers import exchanges_momentum, make_optimizer
from fuelline.trainer.progress import EpochProgress, use_bar
from fuelline.trainer.report import classification_report, epoch_summary, wire_compression
from fuelline.trainer.timing import GpuSampler, StepTimes, gpu_report, report as timing_report, wait_share

__all__ = ["main"]

log = logging.getLogger("fuelline.trainer")


def setup_distributed() -> tuple[int, int, torch.device]:
    """gloo on CPU, NCCL with CUDA; torchrun's environment, or a single process without it."""
    cuda = torch.cuda.is_available()
    if "RANK" in os.environ and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def _truncate_jsonl(path: str, keep) -> None:
    """Keep the lines of a JSON-lines file that ``keep`` accepts (on resume: what came after the
    checkpoint is about to be done again)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and keep(json.loads(line))]
    with open(f"{path}.tmp", "w") as f:
        f.writelines(lines)
    os.replace(f"{path}.tmp", path)


def _check_val_split(info: Mapping[str, Any], servers: Any) -> None:
    """A dataset with a val split to evaluate on: found now, not after the first epoch's training."""
    splits = sorted(info.get("splits") or ())
    if "val" not in splits:
        raise DataError(
            f"the data server at {servers} serves no 'val' split to evaluate on (it has {splits}): serve "
            "a dataset with a val/ folder, or convert with a --val-fraction that leaves whole recordings for val"
        )


class Trainer:
    def __init__(self, args, rank: int, world: int, device: torch.device) -> None:
        self.args, self.rank, self.world, self.device = args, rank, world, device
        torch.manual_seed(args.seed)
        # A data server may still be opening its dataset when the ranks start (a Kubernetes Job beside
        # its StatefulSet): refused connections are waited for as long as a silent server.
        common = dict(endpoints=args.servers, connections=args.connections, rank=rank, world_size=world, hwm=args.hwm,
                      timeout=args.timeout, connect_timeout=args.timeout, tensors=True, curve_keys=args.curve_keys)
        self.train = ServerDataStream(None, split="train", **common)
        self.val = ServerDataStream(None, split="val", **common)
        info = self.train.info
        _check_val_split(info, args.servers)
        if args.label_source is None:
            args.label_source = info.get("label") or "label"
        self.model, self.spec, self.heads, counts = build_model(
            args, self.train.sources, self.train.schema, info, lambda: scan_classes(common, args.label_source, device), device)
        self.classes: list[str] = list(self.spec.class_names or map(str, range(self.spec.classes)))
        self.ddp = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        self.planned_steps = args.epochs * self.train.batches_per_epoch if self.train.batches_per_epoch else None
        self._size_warmup()
        self.comm_state = self._register_hook()
        self.optimizer = make_optimizer(args, self.ddp, self.comm_state)
        self.weights = self._class_weights(counts)
        # One head has nothing to be weighted against.
        self.weighting = make_weighting(args.weighting, self.heads) if len(self.heads) > 1 else None
        self.alphas = {m: 1.0 for m in self.heads}
        self.micro = MicroBatcher(enabled=device.type == "cuda", size=args.micro_batch)
        self.ckpt = Checkpoints(args.checkpoint_dir, rank, world) if args.checkpoint_dir else None
        self.step = 0
        self.steps_this_run = 0  # steps this launch made, over every epoch (what --max-steps counts)
        self.last_loss: float | None = None  # the last micro-batch's, for a non-finite stop's message
        self.epoch_sums: dict[str, float] = {}
        self.gpu = GpuSampler.for_device(device)
        self.progress_bar = use_bar(args.log_format)
        if rank == 0:
            per_class = "not given by the server" if counts is None else counts
            log.info("classes %s, train examples per class %s, class weights %s", self.classes, per_class,
                     "off" if self.weights is None else [round(w, 2) for w in self.weights.tolist()])

    def _class_weights(self, counts: Any) -> torch.Tensor | None:
        """--class-weights from the server's class counts; off where it gives none."""
        if not self.args.class_weights:
            return None
        if counts is None:
            if self.rank == 0:
                log.info("the server gives no class counts: class weights off")
            return None
        return class_weights(counts).to(self.device)

    def _size_warmup(self) -> None:
        """Resolve ``auto`` warm-ups from the run's length, and say once when 1-bit starts (or
        that it never will in this run)."""
        args = self.args
        args.freeze_step = warmup_steps(args.freeze_step, self.planned_steps)
        args.warmup_iters = warmup_steps(args.warmup_iters, self.planned_steps)
        if args.compression != "onebit" and args.optimizer != "onebit-adam":
            return
        adam = args.optimizer in ("adam", "onebit-adam")
        start, option = (args.freeze_step, "--freeze-step") if adam else (args.warmup_iters, "--warmup-iters")
        if self.rank != 0:
            return
        planned = self.planned_steps
        if planned is not None and start >= planned:
            log.warning("1-bit compression never starts in this run: %s %d, and the run has %d steps "
                        "(%d epochs of %d); everything goes uncompressed (fp32). Lower %s, or leave it at auto",
                        option, start, planned, args.epochs, self.train.batches_per_epoch, option)
        else:
            log.info("1-bit from step %d of %s (%s)", start, planned if planned is not None else "?", option)

    def _register_hook(self) -> Any:
        if exchanges_momentum(self.args.optimizer, self.args.compression, self.args.momentum):
            return register_momentum_hook(self.ddp)
        return comm.register(self.ddp, self.args.compression, self.args.warmup_iters)

    # -- checkpoints -----------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        comm_state = getattr(self.comm_state, "state_dict", None)
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "comm": comm_state() if callable(comm_state) else None,
            "weighting": self.weighting.state_dict() if self.weighting else None,
            "alphas": self.alphas,
            "stream": self.train.state_dict(),
            "step": self.step,
            "epoch_sums": self.epoch_sums,
            "torch_rng": torch.get_rng_state(),
        }

    def restore(self) -> None:
        assert self.ckpt is not None
        state = self.ckpt.load_latest()
        if state is None:
            log.warning("no checkpoint in %s: starting afresh", self.args.checkpoint_dir)
            return
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if state["resized"]:
            log.warning("resuming a run of another world size: the rest of the interrupted epoch is shared out "
                        "afresh; compression error-feedback buffers (per rank) start empty, a warm-up done stays done")
        if state["comm"] is not None and hasattr(self.comm_state, "load_state_dict"):
            self.comm_state.load_state_dict(state["comm"], buffers=not state["resized"])
        if self.weighting and state["weighting"]:
            self.weighting.load_state_dict(state["weighting"])
        self.alphas = state["alphas"]
        self.train.load_state_dict(state["stream"])
        self.step = state["step"]
        self.epoch_sums = state["epoch_sums"]
        torch.set_rng_state(state["torch_rng"])
        epoch = state["stream"]["epoch"]
        if self.rank == 0 and self.args.metrics_json:
            _truncate_jsonl(self.args.metrics_json, lambda r: r["epoch"] < epoch)
        if self.args.sample_log:
            _truncate_jsonl(f"{self.args.sample_log}.rank{self.rank}", lambda r: r["step"] <= self.step)
        log.log(logging.INFO if self.rank == 0 else logging.DEBUG,
                "rank %d resumed at step %d, epoch %d/%d batch %d",
                self.rank, self.step, epoch + 1, self.args.epochs, state["stream"]["cursor"])

    def checkpoint(self) -> None:
        if self.ckpt is not None:
            self.ckpt.save(self.step, self.state())

    # -- training ------------------------------------------------------------------------------
    def _logits(self, module: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Logits per head of ``module`` (the DDP wrapper or the bare model); it never sees the labels."""
        label = self.spec.label_source
        return as_heads(module({k: v for k, v in batch.items() if k != label}))

    def _forward_backward(self, batch: Mapping[str, torch.Tensor], scale: float) -> None:
        logits = self._logits(self.ddp, batch)
        losses = modality_losses(logits, batch[self.spec.label_source], self.weights)
        total = sum(self.alphas[m] * losses[m] for m in self.heads) + self.args.l2 * l2_norm(self.model.parameters())
        (total * scale).backward()
        sums = self.epoch_sums
        self.last_loss = float(total.detach())
        sums["loss"] = sums.get("loss", 0.0) + self.last_loss * scale
        for m in self.heads:
            sums[f"L_{m}"] = sums.get(f"L_{m}", 0.0) + float(losses[m].detach()) * scale

    def _probe_micro_batch(self, batch: dict[str, torch.Tensor]) -> None:
        """CUDA: the largest micro-batch that fits, the same on every rank (the smallest found)."""

        def trial(b: Mapping[str, torch.Tensor], scale: float) -> None:
            with self.ddp.no_sync():  # a probe must not all-reduce: the ranks may try different sizes
                logits = self._logits(self.ddp, b)
                loss_sum(F.cross_entropy(z, b[self.spec.label_source]) for z in logits.values()).backward()

        size = self.micro.probe(batch, trial, lambda: self.optimizer.zero_grad(set_to_none=True))
        if dist.is_initialized() and size is not None:
            t = torch.tensor([size], device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            self.micro.size = int(t.item())

    def train_epoch(self) -> dict[str, Any] | None:
        """One epoch (or its rest, after a resume); None if --max-steps stopped it part-way."""
        it = self.train.get_epoch_iterator(as_dict=True)
        sums = self.epoch_sums
        sent0, elems0 = self.comm_state.bytes_sent, self.comm_state.elements
        position = self.train.state_dict()
        total = self.train.batches_per_epoch
        done = 0 if position["history"] else position["cursor"]  # batches of this epoch before a resume
        if total is not None:
            done = min(done, total)
        times = StepTimes(seed=self.rank)
        self.gpu.reset(every=max(1, (total or 100) // 10))  # about ten samples an epoch
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        progress = EpochProgress(position["epoch"], total, epochs=self.args.epochs, initial=done, enabled=self.rank == 0,
                                 bar=self.progress_bar)
        started = time.perf_counter()
        steps_here = 0
        try:
            while True:
                t0 = time.perf_counter()
                batch = next(it, None)
                t1 = time.perf_counter()
                if batch is None:
                    break
                rows, ids = self._train_step(batch)
                t2 = time.perf_counter()
                steps_here += 1
                self._count(rows, t1 - t0, t2 - t1)
                times.record(t1 - t0, t2 - t1, arrival=t1)
                self.gpu.maybe_sample(steps_here)
                progress.update(done + steps_here, sums.get("loss", 0.0) / sums["steps"],
                                wait_share(sums["wait"], sums["step_time"]))
                self._log_samples(ids)
                if self._checkpoint_or_stop():
                    return None
        finally:
            progress.close()
        return self._epoch_figures(time.perf_counter() - started, sent0, elems0, times)

    def _train_step(self, batch: dict[str, Any]) -> tuple[int, list[int] | None]:
        """One optimizer step on a batch: its rows, and its sample ids where it has them."""
        ids = batch.pop("sample_id").tolist() if "sample_id" in batch else None  # (optional)
        batch.pop("t_start", None)
        rows = len(batch[self.spec.label_source])
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        if self.micro.enabled and self.micro.size is None:
            self._probe_micro_batch(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.micro.run(batch, self._forward_backward, lambda: self.optimizer.zero_grad(set_to_none=True), self.ddp.no_sync)
        self.optimizer.step()
        check_finite(self.model, self.step + 1, self.last_loss)  # before any checkpoint of it
        return rows, ids

    def _count(self, rows: int, wait: float, step_time: float) -> None:
        self.step += 1
        self.steps_this_run += 1
        sums = self.epoch_sums
        sums["steps"] = sums.get("steps", 0) + 1
        sums["samples"] = sums.get("samples", 0) + rows
        sums["wait"] = sums.get("wait", 0.0) + wait
        sums["step_time"] = sums.get("step_time", 0.0) + step_time

    def _log_samples(self, ids: list[int] | None) -> None:
        """--sample-log: the sample ids of this step, a JSON line in this rank's file."""
        if self.args.sample_log and ids is not None:
            with open(f"{self.args.sample_log}.rank{self.rank}", "a") as f:
                f.write(json.dumps({"step": self.step, "epoch": self.train.state_dict()["epoch"], "ids": ids}) + "\n")

    def _checkpoint_or_stop(self) -> bool:
        """A checkpoint every --checkpoint-every steps, and one where --max-steps stops the run
        (True then)."""
        args = self.args
        due = bool(args.checkpoint_every) and self.step % args.checkpoint_every == 0
        if due:
            self.checkpoint()
        if args.max_steps and self.steps_this_run >= args.max_steps:
            if not due:
                self.checkpoint()
            return True
        return False

    def _epoch_figures(self, seconds: float, sent0: int, elems0: int, times: StepTimes) -> dict[str, Any]:
        """What an epoch measured; its sums start again for the next."""
        sums = self.epoch_sums
        sent = self.comm_state.bytes_sent - sent0
        elems = self.comm_state.elements - elems0
        steps = max(1, sums.get("steps", 0))
        out = {
            "train_loss": sums.get("loss", 0.0) / steps,
            "samples_per_s": sums.get("samples", 0) * self.world / max(seconds, 1e-9),
            "data_wait_s": sums.get("wait", 0.0) / steps,
            "step_time_s": sums.get("step_time", 0.0) / steps,
            "grad_bytes_per_element": sent / elems if elems else None,
            # The whole run's so far (a resumed run's counters come from its checkpoint).
            "run_grad_bytes_per_element": (self.comm_state.bytes_sent / self.comm_state.elements
                                           if self.comm_state.elements else None),
            "per_modality_loss": {m: sums.get(f"L_{m}", 0.0) / steps for m in self.heads},
            **self._timing(times, sums),
        }
        self.epoch_sums = {}
        return out

    def _timing(self, times: StepTimes, sums: dict[str, float]) -> dict[str, Any]:
        """The epoch's timing figures over every rank (one all_gather_object an epoch). The shares
        are over the whole epoch, resumed or not; the percentiles over the steps this run made."""
        mine = {
            "times": times.state(),
            "wait": sums.get("wait", 0.0),
            "step": sums.get("step_time", 0.0),
            "gpu": self.gpu.samples if self.gpu.read is not None else None,
            "gpu_mem_mb": torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None,
        }
        gathered: list = [None] * self.world
        if dist.is_initialized():
            dist.all_gather_object(gathered, mine)
        else:
            gathered = [mine]
        mem = [g["gpu_mem_mb"] for g in gathered if g["gpu_mem_mb"] is not None]
        return {
            **timing_report([g["times"] for g in gathered], totals=[(g["wait"], g["step"]) for g in gathered]),
            "gpu_util": gpu_report([g["gpu"] for g in gathered]),
            "gpu_mem_max_mb": max(mem) if mem else None,
        }

    def evaluate(self) -> dict[str, Any]:
        """Fused-head (or single-output) predictions over the whole val split, each example once:
        the wrap-padding's repeats are dropped by ``sample_id``, or, where the server sends none,
        by position (rank spans are contiguous in the epoch's order, and only the last ends in
        repeats: the split's first rows again)."""
        self.model.eval()
        ids: list | None = []
        preds, labels = [], []
        with torch.no_grad():
            for batch in self.val.get_epoch_iterator(as_dict=True):
                if ids is not None and "sample_id" in batch:
                    ids += batch.pop("sample_id").tolist()
                else:
                    ids = None
                batch.pop("t_start", None)
                batch = {k: v.to(self.device) for k, v in batch.items()}
                logits = self._logits(self.model, batch)
                preds += logits[EVAL_HEAD if EVAL_HEAD in logits else self.heads[0]].argmax(dim=1).tolist()
                labels += batch[self.spec.label_source].tolist()
        self.model.train()
        gathered: list = [None] * self.world
        if dist.is_initialized():
            dist.all_gather_object(gathered, (ids, preds, labels))
        else:
            gathered = [(ids, preds, labels)]
        seen: dict[Any, tuple[int, int]] = {}
        if all(i is not None for i, _, _ in gathered):
            for i, p, y in gathered:
                for sid, pp, yy in zip(i, p, y):
                    seen.setdefault(sid, (pp, yy))
        else:
            rows = int(self.val.info["rows"])
            both = [(pp, yy) for _, p, y in gathered for pp, yy in zip(p, y)]
            seen = dict(enumerate(both[:rows]))
        pred = np.array([v[0] for v in seen.values()], dtype=np.int64)
        true = np.array([v[1] for v in seen.values()], dtype=np.int64)
        return classification_report(pred, true, self.classes) | {"windows": len(seen)}

    def _average(self, values: dict[str, float]) -> dict[str, float]:
        if not dist.is_initialized():
            return values
        t = torch.tensor([values[m] for m in self.heads], dtype=torch.float64)
        dist.all_reduce(t)
        return {m: float(v) / self.world for m, v in zip(self.heads, t)}

    def run(self) -> int:
        args = self.args
        if args.resume:
            self.restore()
        while True:
            epoch = self.train.state_dict()["epoch"]
            if epoch >= args.epochs:
                break
            stats = self.train_epoch()
            if stats is None:
                log.log(logging.INFO if self.rank == 0 else logging.DEBUG, "rank %d stopped after %d steps (--max-steps)",
                        self.rank, args.max_steps)
                return 0
            report = self.evaluate()
            losses = self._average(stats.pop("per_modality_loss"))
            if self.weighting is not None:
                self.weighting.update(losses)
                self.alphas = self.weighting.alphas()
            line = {
                "epoch": epoch, **stats, "val_accuracy": report["accuracy"], "val_macro_f1": report["macro_f1"],
                "val_recall": report["recall"], "val_windows": report["windows"], "modality_loss": losses,
                "alphas": self.alphas, **wire_compression(args.optimizer, args.compression, self.comm_state),
                "optimizer": args.optimizer, "world_size": self.world, "step": self.step,
            }
            self.checkpoint()
            if self.rank == 0:
                text = json.dumps(line)
                if args.metrics_json:
                    with open(args.metrics_json, "a") as f:
                        f.write(text + "\n")
                # stdout is for people unless asked for JSON; the summary then still reaches them on stderr.
                summary = epoch_summary(line, args.epochs)
                if args.json_stdout:
                    print(text, flush=True)
                    print(summary, file=sys.stderr, flush=True)
                else:
                    print(summary, flush=True)
        return 0

    def close(self) -> None:
        """Close the data streams (their sockets and threads) and release the checkpoint folder;
        the process group stays up."""
        self.train.close()
        self.val.close()
        if self.ckpt is not None:
            self.ckpt.close()

    def release(self) -> None:
        """Drop everything that holds the process group (DDP's reducer and its comm hook, the
        hook's state, the optimizer), so that destroying the group really frees it."""
        for name in ("optimizer", "comm_state", "ddp"):
            self.__dict__.pop(name, None)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from fuelline.protocol.common.logs import configure_logging
    from fuelline.protocol.common.stacks import dump_stacks_on_usr1

    configure_logging(args.log_level, args.log_format)
    dump_stacks_on_usr1()  # (kill -USR1: where a rank's threads are, on its stderr)
    if "LOCAL_RANK" in os.environ:  # a rank of torchrun's: it ends with its launcher
        exit_with_parent()
    rank, world, device = setup_distributed()
    trainer: Trainer | None = None
    ok = False
    # Errors are caught and logged here rather than raised through: a traceback still being
    # handled keeps its frames, and with them the optimizer or DDP, alive past the teardown.
    try:
        trainer = Trainer(args, rank, world, device)
        code = trainer.run()
        ok = True
        return code
    except (CheckpointError, DataError) as exc:  # bad input or options: one line says which
        log.error("rank %d: %s", rank, exc)
        return 1
    except NonFiniteError as exc:  # every rank sees it at the same step: one says it
        log.log(logging.ERROR if rank == 0 else logging.DEBUG, "rank %d: %s", rank, exc)
        return 3
    except KeyboardInterrupt:
        hint = f": continue with the same command and --resume (from {args.checkpoint_dir})" if args.checkpoint_dir else ""
        log.log(logging.ERROR if rank == 0 else logging.DEBUG, "rank %d interrupted%s", rank, hint)
        return 130
    except Exception:
        log.exception("rank %d failed", rank)
        return 1
    finally:
        shutdown(trainer, ok)
