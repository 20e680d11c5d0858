"""Worker actor: one TP rank's model forward into the KV pool its writer owns."""
from __future__ import annotations

import logging
import time
from typing import Optional

import msgspec
import zmq

from pushkv import envs, limits
from pushkv import messages as m
from pushkv.actor import Actor
from pushkv.config import DeploymentConfig, InstanceConfig, marks_endpoint, rank_device
from pushkv.faults import Faults
from pushkv.kv import checksum, damage
from pushkv.kv import layout as L
from pushkv.kv.pool import Pool, attach_worker_pool
from pushkv.model import sampling
from pushkv.worker.marks import LayerMarks

log = logging.getLogger(__name__)
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")  # gloo's and NCCL's words


def worker_name(inst: InstanceConfig, rank: int) -> str:
    """The process's name (its fault points' files are named by it)."""
    return f"{inst.name}-worker-{rank}"


def peer_rank_gone(e: BaseException) -> bool:
    """Whether a step's collective failed because another rank of the group died (its socket closed)."""
    return isinstance(e, RuntimeError) and any(w in str(e) for w in PEER_GONE)


class Worker(Actor):
    def __init__(self, cfg: DeploymentConfig, inst: InstanceConfig, rank: int, faults: Optional[Faults] = None):
        super().__init__(worker_name(inst, rank), cfg.control_endpoint, cfg.trace_endpoint, cfg.secret_file,
                         limits.msg_cap_bytes(cfg))
        self.cfg = cfg
        self.inst = inst
        self.rank = rank
        self.layout = L.instance_layout(cfg, inst, rank)  # cut to match the peer instance
        self.pool: Pool | None = None
        self.marks: LayerMarks | None = None
        self._kernel_failed = False  # --kv-verify: the Triton checksum kernel raised once; torch from then on
        self.faults = faults
        if faults is not None:  # tests: point "execute" before each step, wired into the dispatch once
            self._handlers[m.ExecuteStep] = faults.before("execute", self.on_ExecuteStep)

    def setup(self) -> None:
        import torch

        from pushkv.model.build import build_model

        torch.set_num_threads(max(1, envs.PUSHKV_THREADS))
        self.device = rank_device(self.inst, self.rank)
        if self.device != "cpu":
            torch.cuda.set_device(self.device)
        group = None
        if self.inst.tp > 1:
            import torch.distributed as dist

            from pushkv.worker.tp_group import init_group

            init_group("gloo" if self.device == "cpu" else "nccl", self.inst.dist_init, self.rank, self.inst.tp)
            group = dist.group.WORLD
        self.model = build_model(self.cfg.model, self.rank, self.inst.tp, self.device, group,
                                 max_num_seqs=self.inst.max_num_seqs, label=self.name)
        mine = self.model.kv_layout(self.inst.num_blocks, self.inst.block_size)
        if (mine.kv_heads, mine.head_start) != (self.layout.kv_heads, self.layout.head_start):
            raise RuntimeError(f"model layout {mine} disagrees with pool layout {self.layout}")
        self.pool = self._attach()
        self.layer_pools = L.layer_views(self.pool.tensor, self.layout)  # per layer, any layout
        if self.model.batched is not None:
            warm = self.model.batched.warmup(self.layer_pools)
            warm += self.model.batched.warm_fresh(self.inst.max_batch_tokens)
            graphs = self.model.batched.capture(self.layer_pools)
            log.info("%s: batched engine warm in %.1fs, %d decode CUDA graphs captured in %.1fs",
                     self.name, warm, len(self.model.batched.graphs), graphs)
            sampling.warmup(self.cfg.model.vocab_size, self.device)
        if self.takes_marks():
            self.marks = LayerMarks(marks_endpoint(self.inst.writer_endpoints[self.rank]), L.layer_groups(self.layout),
                                    self.device, limits.msg_cap_bytes(self.cfg))
        sock = self.socket(zmq.DEALER, self.inst.worker_endpoints[self.rank], bind=True)
        self.sched = self.add_channel(sock, m.DEC_SCHED_TO_WORKER, f"{self.inst.name}-scheduler")

    def takes_marks(self) -> bool:
        """A P worker marks each layer group stored for its writer when the plan streams layers."""
        return L.transfer_of(self.cfg).stream == "layer" and self.inst.role == "prefill"

    def _attach(self) -> Pool:
        """The pool its writer owns: the handle the supervisor passed on (shm or CUDA IPC)."""
        return attach_worker_pool(None, self.cfg.deployment_id, self.inst.name, self.rank, self.layout,
                                  self.cfg.model.dtype)

    def teardown(self) -> None:
        if self.marks is not None:
            self.marks.close()
        self.layer_pools = []  # views pin the mapping
        if self.pool is not None:
            self.pool.close()
        if self.inst.tp > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    def on_ExecuteStep(self, msg: m.ExecuteStep) -> None:
        t0 = time.perf_counter()
        try:
            on_layer = self.marks.hook(msg.step_id, msg.stream) if self.marks is not None and msg.stream else None
            out = self.model.execute_sampled(self._physical(msg.seqs), self.layer_pools, on_layer)
        except Exception as e:
            if peer_rank_gone(e):  # an expected fault (the supervisor restarts the instance): one line, no trace
                log.error("%s: step %d failed: a peer TP rank is gone (%s)", self.name, msg.step_id,
                          str(e).splitlines()[0][:200])
            else:
                log.exception("%s: step %d failed", self.name, msg.step_id)
            self.send(self.sched, m.StepFailed(msg.step_id, f"{type(e).__name__}: {e}"))
            return
        # By StepDone every K/V of a P step must be in the pool: the WRITE (or the staging copy)
        # that StreamKV / SendKV start reads it from another stream. Reading the sampled tokens
        # (tolist) waits for the step; a step that samples nothing (only non-final prefill
        # chunks) reads an empty tensor, which does not, so P waits here (without it a chunk's
        # part went out before its K/V was stored: KV check mismatches on the GPU). D's and
        # local steps' K/V are read by no other stream.
        if not out.tokens and self.device != "cpu" and self.inst.role == "prefill":
            self._step_stored()
        try:  # --kv-verify: the KV as stored
            sums = tuple(self._checksums(s) for s in msg.seqs if s.checksum)
        except Exception:  # the step itself succeeded: answer it; D sees no checksums and says so
            log.exception("%s: KV checksums of step %d failed", self.name, msg.step_id)
            sums = ()
        self.send(self.sched, m.StepDone(msg.step_id, tuple(out.tokens), time.perf_counter() - t0, out.logprobs,
                                         sums, out.prompt))

    def _step_stored(self) -> None:
        import torch

        torch.cuda.current_stream(self.device).synchronize()
        self.counters["steps_synced"] += 1

    def _checksums(self, s: m.SeqWork) -> m.KVChecksums:
        """This rank's checksums of a prompt whose last chunk this step stored (kv/checksum.py)."""
        n = s.start_pos + len(s.token_ids)
        unit_tokens = self.cfg.prefill.block_size
        units = checksum.plan_units(s.checksum, n, unit_tokens, salt=s.seq_id)
        sums = checksum.to_wire(self.layout, self._unit_sums(s.block_table, n, units, unit_tokens), units,
                                unit_tokens, n)
        if self.faults is not None and self.faults.fire("kv_flip_source"):  # tests of --kv-verify: after the sums
            damage.flip_last_token(self.pool, self.layout, s.block_table, n)
        return sums

    def _unit_sums(self, table, num_tokens: int, units, unit_tokens: int):
        """The kernel on CUDA (PUSHKV_CHECKSUM=torch keeps torch's ops), torch on the CPU. Both
        give the same sums, so a kernel that fails here falls back to torch for good."""
        args = (self.layer_pools, self.layout, table, num_tokens, units, unit_tokens)
        if self.device != "cpu" and envs.PUSHKV_CHECKSUM == "triton" and not self._kernel_failed:
            try:
                from pushkv.model.kernels.triton_checksum import unit_sums

                return unit_sums(*args)
            except Exception:
                self._kernel_failed = True
                self.counters["checksum_kernel_failed"] += 1
                log.exception("%s: checksum kernel failed; torch computes the sums from now on", self.name)
        return checksum.unit_sums(*args)

    def on_VerifyKV(self, msg: m.VerifyKV) -> None:
        """D, before the first decode step: do the blocks hold what P stored? (this rank's heads)"""
        t0 = time.perf_counter()
        exp = msg.checksums
        try:
            sums = self._unit_sums(msg.block_ids, exp.num_tokens, exp.units, exp.unit_tokens)
            reason, checked = checksum.verify(self.layout, exp, sums)  # on the device: two numbers come back
        except Exception as e:  # a malformed expectation fails this request, not the worker
            log.exception("%s: KV verification failed to run transfer_id=%s", self.name, msg.transfer_id)
            reason, checked = f"KV verification could not run: {type(e).__name__}: {e}", 0
        if reason:
            log.error("%s: %s transfer_id=%s", self.name, reason, msg.transfer_id)
        self.send(self.sched, m.KVVerified(msg.transfer_id, msg.generation, reason, checked, time.perf_counter() - t0))

    def on_LoadLora(self, msg: m.LoadLora) -> None:
        """A LoRA adapter loaded at runtime into its slot (between steps: this loop runs one message at a time)."""
        from pushkv.model.lora import load_adapter
        from pushkv.model.lora_files import read_adapter

        try:
            info = read_adapter(msg.name, msg.path, self.cfg.model, self.cfg.model.lora.max_rank)
            if self.model.lora_bank is None:
                raise ValueError("LoRA is off on this instance: start it with --enable-lora")
            pairs = load_adapter(info, self.cfg.model, self.model.plan, self.device)
            if self.model.lora_bank.put(msg.slot, pairs) and self.model.batched is not None:
                self.model.batched.drop_graphs()  # captured on the bank's old tensors: captured again on use
        except Exception as e:  # a bad adapter fails its load, not the worker
            log.exception("%s: LoRA adapter %s did not load", self.name, msg.name)
            if self.model.lora_bank is not None and self.model.batched is not None:
                # a load that failed midway may have given a layer a kind no graph captured reads: captured again
                self.model.batched.drop_graphs()
            self.send(self.sched, m.LoraChanged(msg.name, f"{type(e).__name__}: {e}", msg.slot))
            return
        log.info("%s: LoRA adapter %s loaded in slot %d", self.name, msg.name, msg.slot)
        self.send(self.sched, m.LoraChanged(msg.name, "", msg.slot))

    def on_UnloadLora(self, msg: m.UnloadLora) -> None:
        """A retired slot freed (no answer: the scheduler needs none, and may give the slot to a load next, whose
        answer alone it waits for)."""
        if self.model.lora_bank is not None:
            self.model.lora_bank.clear(msg.slot)
        log.info("%s: LoRA adapter %s unloaded from slot %d", self.name, msg.name, msg.slot)

    def _physical(self, seqs):
        """Block tables name logical blocks; the pool is cut into sub-blocks (layout.py)."""
        if L.subs_per_block(self.layout) == 1:
            return seqs
        return [msgspec.structs.replace(s, block_table=tuple(L.expand_table(self.layout, s.block_table)))
                for s in seqs]
