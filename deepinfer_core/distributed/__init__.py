"""Data parallelism with expert parallelism over torch.distributed (docs/distributed.md).

``LLM(model, data_parallel_size=N, enable_expert_parallel=True)`` runs N ranks: each its own engine (scheduler,
state, attention, router, shared expert) on its share of the requests, the routed experts split across ranks and
reached by all-to-all. ``launcher.py`` starts the ranks from one process (torch.multiprocessing spawn), ``worker.py``
is a rank (the lockstep loop, its share of a ``generate``), ``rank.py`` finds a rank's place and joins the process
group (also under torchrun), ``placement.py`` spreads requests, ``messages.py`` turns what crosses processes into
plain data. The dispatch and combine are an op: ``deepinfer_core/ops/expert_parallel.py``.
"""
