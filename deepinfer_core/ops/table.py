"""The op table: named tensor ops the model calls, each a reference op unless a backend overrides it.

Model code never calls a vendor library; it calls ``ops.<name>(...)``. The plain-torch reference
ops (``deepinfer_core.ops.reference``) are the spec every backend's override must match.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deepinfer_core.errors import DeepInferError

_REFERENCE_OPS: dict[str, Callable] = {}


class UnknownOpError(DeepInferError, KeyError):
    """An override names an op the table does not define."""


def reference_op(fn: Callable) -> Callable:
    """Decorator: register ``fn`` as the reference implementation of the op named ``fn.__name__``."""
    _REFERENCE_OPS[fn.__name__] = fn
    return fn


def reference_ops() -> dict[str, Callable]:
    """All reference ops by name (imports the reference module on first use)."""
    from deepinfer_core.ops import expert_parallel, reference  # noqa: F401  (register the ops)

    return dict(_REFERENCE_OPS)


def written_back(fn: Callable) -> Callable:
    """The in-place form of an out-of-place op ``fn(x, *args, **kwargs)``: its result copied into ``x``; returns ``x``."""

    def in_place(x, *args, **kwargs):
        return x.copy_(fn(x, *args, **kwargs))

    return in_place


def _composed(factory: str) -> Callable[..., Callable]:
    """The reference module's ``factory`` (it builds a derived op from its parts), imported on first use."""

    def build(*parts: Callable) -> Callable:
        from deepinfer_core.ops import reference

        return getattr(reference, factory)(*parts)

    return build


DERIVED: dict[str, tuple[tuple[str, ...], Callable[..., Callable], str]] = {
    "apply_rope_": (("apply_rope",), written_back, "written back"),
    "compressor_entries": (("compressor_window", "compressor_pool"), _composed("pooled_windows"), "composed"),
    "compressor_entries_rope": (("compressor_entries", "apply_rope_"), _composed("entries_rope"), "composed"),
    "rms_norm_rope": (("rms_norm", "unweighted_rms_norm", "apply_rope_"), _composed("normed_rope"), "composed"),
    "hc_pre_normed": (("hc_pre", "rms_norm"), _composed("pre_normed"), "composed"),
    "hc_post_sum": (("hc_post",), _composed("post_sum"), "composed"),
    "roped_sink_attention": (("rms_norm_rope", "sink_attention", "apply_rope_"), _composed("roped_attention"),
                             "composed"),
    "roped_sparse_sink_attention": (("rms_norm_rope", "sparse_sink_attention", "apply_rope_"),
                                    _composed("roped_sparse_attention"), "composed"),
    "indexer_topk_index": (("indexer_topk", "visible_index"), _composed("selected_index"), "composed"),
    "indexer_topk_index_counts": (("indexer_topk_index",), _composed("counted_index"), "composed"),
}
"""Op -> (the ops it is made of, how it is made from them, a label). Where a backend overrides a part but not the op
itself, the op is rebuilt from the table's current parts: the model calls ``apply_rope_`` and ``compressor_entries``,
and a backend that overrides only ``apply_rope`` (its result is written back) or only ``compressor_pool`` (composed
with the window op) keeps its kernel in use; ``rms_norm_rope`` is composed of the norms and the in-place RoPE,
``hc_pre_normed`` of ``hc_pre`` and ``rms_norm``, ``hc_post_sum`` of ``hc_post``, ``compressor_entries_rope`` of
the entries and the in-place RoPE, ``roped_sink_attention`` of the query norm, the attention and the in-place RoPE,
``roped_sparse_sink_attention`` likewise of the sparse attention, ``indexer_topk_index`` of the selection and its
compaction into indices, ``indexer_topk_index_counts`` of ``indexer_topk_index`` under the mask its counts stand
for."""


class OpTable:
    """Named ops resolved once: a backend's overrides on top of the reference ops.

    ``OpTable({"rms_norm": fast_rms_norm}, source="nvidia")`` gives ``table.rms_norm`` the fast
    version and every other op its reference version. ``table.sources()`` says which is which.
    """

    def __init__(self, overrides: Mapping[str, Callable] | None = None, source: str = "override",
                 variants: Callable[[str], Mapping[str, Callable]] | None = None):
        self._ops: dict[str, Callable] = reference_ops()
        self._sources: dict[str, str] = {name: "reference" for name in self._ops}
        self._derived: set[str] = set()  # DERIVED ops currently built from their parts
        self._variants = variants  # the backend's ``op_variants`` (``variants``), or None
        for name, fn in (overrides or {}).items():
            self.override(name, fn, source)

    def override(self, name: str, fn: Callable, source: str) -> None:
        """Replace op ``name`` by ``fn``; ``source`` names who provided it (shown by ``sources()``). Overriding a
        part of a ``DERIVED`` op also rebuilds that op from the table's parts, unless it has an override of its own
        (whichever order the two come in), and so on for ops derived from that one."""
        if name not in self._ops:
            raise UnknownOpError(f"{source} overrides unknown op {name!r}; known ops: {sorted(self._ops)}")
        if not callable(fn):
            raise TypeError(f"{source} override for op {name!r} is not callable: {fn!r}")
        self._ops[name] = fn
        self._sources[name] = source
        self._derived.discard(name)
        self._rebuild_derived_from(name, source)

    def _rebuild_derived_from(self, name: str, source: str) -> None:
        for derived, (parts, build, label) in DERIVED.items():
            if name in parts and (self._sources[derived] == "reference" or derived in self._derived):
                self._ops[derived] = build(*(self._ops[part] for part in parts))
                self._sources[derived] = f"{source} ({name}, {label})"
                self._derived.add(derived)
                self._rebuild_derived_from(derived, source)

    def __getattr__(self, name: str) -> Callable:
        try:
            return self.__dict__["_ops"][name]
        except KeyError:
            raise AttributeError(f"op table has no op {name!r}") from None

    def names(self) -> list[str]:
        return sorted(self._ops)

    def variants(self, kind: str) -> dict[str, Callable]:
        """The backend's own implementations of ops for the mode ``kind`` a feature plugin turns on (e.g.
        ``"batch_invariant"``; ``Backend.op_variants``): op name -> implementation, none installed yet. A plugin that
        runs the mode installs them with ``override``. Empty for a table built without a backend or a backend that
        offers none for ``kind``."""
        if self._variants is None:
            return {}
        offered = dict(self._variants(kind))
        unknown = sorted(set(offered) - set(self._ops))
        if unknown:
            raise UnknownOpError(f"the backend offers {kind!r} variants of unknown ops {unknown}; known ops: "
                                 f"{sorted(self._ops)}")
        return offered

    def sources(self) -> dict[str, str]:
        """Op name -> who implements it ("reference" or the overriding backend / plugin)."""
        return dict(self._sources)
