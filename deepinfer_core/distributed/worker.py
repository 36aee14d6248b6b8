"""A rank of a data-parallel engine: its own engine on its share of the requests, stepped in lockstep with the
other ranks (every forward of an expert-parallel model is a collective), and ``rank_main``, the process a spawned
rank runs (``launcher.py``)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from deepinfer_core.distributed import messages
from deepinfer_core.distributed.placement import outstanding_tokens, spread_requests
from deepinfer_core.distributed.rank import (
    RankInfo,
    check_world_size,
    collective_device,
    join_process_group,
    rank_from_environment,
)
from deepinfer_core.engine.engine import Engine, RequestRejectedError
from deepinfer_core.engine_args import EngineArgs, EngineArgsError
from deepinfer_core.models.interface import CausalLM, ExpertParallelModel
from deepinfer_core.outputs import RequestOutput
from deepinfer_core.sampling.noise import derive_seed
from deepinfer_core.sampling.params import SamplingParams


class DataParallelWorker:
    """This process's part of ``LLM(data_parallel_size=N)``: rank ``info.rank`` of N.

    Every rank sees every prompt of a ``generate`` call and computes the same placement (``placement.py``), runs
    its own share on its own engine, and the outputs are gathered to every rank in input order. Steps go in lockstep:
    each iteration all ranks agree (an all-reduce of a flag) whether any has work; a rank without work (or whose
    engine step ran no forward) runs ``model.idle_step()``, so every MoE layer of every rank takes part in every
    all-to-all. Request ids and the seeds of unseeded requests are numbered over all prompts, as one engine would.
    """

    def __init__(self, info: RankInfo, args: EngineArgs):
        check_world_size(info, args.data_parallel_size)
        self.info = info
        self.expert_parallel = args.enable_expert_parallel
        self.seed = args.seed
        self._flag_device = torch.device("cpu")
        self._ids = itertools.count()
        self._unseeded = itertools.count()
        self.num_idle_steps = 0
        self.stats: dict[str, Any] = {}

    @classmethod
    def from_environment(cls, args: EngineArgs) -> DataParallelWorker | None:
        """The worker of this process when it is a rank of more than one (torchrun, or ``launcher.py``), else None."""
        info = rank_from_environment()
        return None if info is None else cls(info, args)

    def connect(self, backend) -> None:
        """Join the process group over the device backend's collective library (``Capabilities.distributed_backend``)."""
        name = backend.capabilities().distributed_backend
        join_process_group(self.info, name, backend.device)
        self._flag_device = collective_device(name, backend.device)

    def prepare(self, model: CausalLM) -> None:
        """Split the routed experts across ranks when expert parallelism is on."""
        if not self.expert_parallel:
            return
        if not isinstance(model, ExpertParallelModel):
            raise EngineArgsError(f"enable_expert_parallel=True: {type(model).__name__} cannot split its experts "
                                  "(it does not implement models/interface.py's ExpertParallelModel)")
        model.shard_experts(self.info.rank, self.info.world_size)

    # ------------------------------------------------------------------ generate
    def generate(self, llm, prompts: Sequence[Any], params: Sequence[SamplingParams]) -> list[RequestOutput]:
        """``LLM.generate`` on a rank: this rank's share runs here; every rank returns all outputs in input order."""
        tokenized = [_tokenize(llm, p) for p in prompts]
        params = [self._seeded(p) for p in params]
        group_ids = [str(next(self._ids)) for _ in prompts]
        costs = [outstanding_tokens(len(ids or ()), p.max_tokens, p.n, llm.max_model_len)
                 for (_, ids, _), p in zip(tokenized, params)]
        owners = spread_requests(costs, self.info.world_size)
        local: dict[int, RequestOutput] = {}
        index_of: dict[str, int] = {}
        for i, ((text, ids, refused), p) in enumerate(zip(tokenized, params)):
            if owners[i] != self.info.rank:
                continue
            try:
                if refused is not None:
                    raise refused
                llm.engine.add_request(group_ids[i], text, ids, p)
                index_of[group_ids[i]] = i
            except RequestRejectedError as exc:
                local[i] = RequestOutput(group_ids[i], text, ids, None, [], True, error=str(exc))
        for output in self.run(llm.engine, llm.model):
            local[index_of[output.request_id]] = output
        self.stats = self._stats(llm.engine, len(index_of))
        return self._gather(local, len(prompts))

    def _stats(self, engine: Engine, num_requests: int) -> dict[str, Any]:
        """This rank's counters after a ``generate`` (requests of the last call; steps, idle steps, preemptions and
        prefix-cache hits since the engine started), what it runs on (device, dtype, token budget, scheduling), and
        under ``"metrics"`` its ``engine.metrics`` by name (what ``LLM.get_metrics()`` returns in one process; EPLB's
        ``deepinfer:eplb_moe_lb`` among them)."""
        config = engine.config
        return {"rank": self.info.rank, "requests": num_requests, "steps": engine.num_steps,
                "idle_steps": self.num_idle_steps, "preemptions": engine.scheduler.num_preemptions,
                "prefix_hits": engine.state_manager.hits, "device": str(engine.model.device),
                "dtype": str(engine.model.dtype).removeprefix("torch."),
                "max_num_batched_tokens": config.max_num_batched_tokens, "async_scheduling": config.async_scheduling,
                "metrics": {metric.name: metric.value for metric in engine.metrics.snapshot()}}

    def run(self, engine: Engine, model: CausalLM) -> Iterator[RequestOutput]:
        """Step ``engine`` until no rank has work left, one forward (or idle step) per rank per iteration."""
        while True:
            busy = engine.has_unfinished()
            if not self._any_rank(busy):
                return
            steps = engine.num_steps
            if busy:
                yield from engine.step()
            if engine.num_steps == steps:  # no forward this iteration: serve the others' tokens
                self._idle(model)
            engine.step_boundary()  # every rank, every iteration: plugins may run collectives (EPLB)

    def _idle(self, model: CausalLM) -> None:
        self.num_idle_steps += 1
        if self.expert_parallel:
            model.idle_step()

    def _any_rank(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], device=self._flag_device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def _seeded(self, params: SamplingParams) -> SamplingParams:
        """An unseeded request's seed as one engine numbers it (by arrival over all prompts)."""
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=derive_seed(self.seed, next(self._unseeded)))

    def _gather(self, local: dict[int, RequestOutput], count: int) -> list[RequestOutput]:
        mine = [(i, messages.output_to_plain(o)) for i, o in local.items()]
        gathered: list[Any] = [None] * self.info.world_size
        dist.all_gather_object(gathered, mine)
        results: list[RequestOutput | None] = [None] * count
        for pairs in gathered:
            for i, data in pairs:
                results[i] = local[i] if i in local else messages.output_from_plain(data)
        return results  # type: ignore[return-value]


def _tokenize(llm, prompt) -> tuple[str | None, list[int] | None, RequestRejectedError | None]:
    """``(text, token ids, None)``, or the prompt as given and why it is refused."""
    try:
        return *llm._tokenize(prompt), None
    except RequestRejectedError as exc:
        text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        return text, None, exc


# ---------------------------------------------------------------------- a spawned rank's process
@dataclasses.dataclass(frozen=True)
class RankLaunch:
    """What a spawned rank needs to start: its place, the rendezvous port, ``LLM``'s arguments (plain data)."""

    rank: int
    world_size: int
    master_port: int
    model: str | None
    kwargs: dict[str, Any]
    threads: int
    parent_pid: int


def rank_main(launch: RankLaunch, inbox, outbox) -> None:
    """Build this rank's ``LLM`` and serve the parent's ``generate`` calls until told to stop (or the parent is
    gone). Replies ``("ready" | "outputs" | "error", rank, payload)``; an error's payload is its traceback."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(launch.master_port), RANK=str(launch.rank),
                      WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.rank),
                      LOCAL_WORLD_SIZE=str(launch.world_size))
    torch.set_num_threads(launch.threads)
    failed = False
    try:
        from deepinfer_core.llm import LLM

        llm = LLM(launch.model, **launch.kwargs)
        outbox.put(("ready", launch.rank, None))
        while (message := _receive(inbox, launch.parent_pid)) is not None:
            _, prompts, params = message
            outputs = llm.generate(prompts, [messages.params_from_plain(p) for p in params], use_tqdm=False)
            plain = [messages.output_to_plain(o) for o in outputs] if launch.rank == 0 else None
            outbox.put(("outputs", launch.rank, {"outputs": plain, "stats": llm._parallel.stats}))
    except BaseException:  # noqa: BLE001 - the parent reports it and stops every rank
        failed = True
        outbox.put(("error", launch.rank, traceback.format_exc()))
    finally:
        outbox.close()
        outbox.join_thread()
    if failed:
        sys.exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()


def _receive(inbox, parent_pid: int):
    """The parent's next message, or None on ``stop`` or when the parent is gone."""
    while True:
        try:
            message = inbox.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return None
            continue
        return None if message[0] == "stop" else message
