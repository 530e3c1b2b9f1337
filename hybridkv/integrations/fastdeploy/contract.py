"""The contract between FastDeploy's patched engine and the facade: the patch series binds the engine
(:meth:`EngineContractMixin.bind_engine`), a request's state sets are charged through an explicit
ticket (:meth:`EngineContractMixin.state_blocks_for`), and ``allocate_gpu_blocks``' two call forms are
told apart on exact types (:func:`allocation_args`). See docs/fastdeploy.md, "The contract"."""

from __future__ import annotations

from typing import Any

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.records import RequestId
from hybridkv.errors import RequestStateError
from hybridkv.integrations.fastdeploy.types import ALLOCATE_FORMS, PATCH_SERIES, SPLITWISE_ROLES, EnginePatchError
from hybridkv.units import is_integer


class EngineContractMixin:
    """Part of :class:`~hybridkv.integrations.fastdeploy.facade.FastDeployBlockManager`: the binding and
    the tickets. Ownership: ``_binding`` is set once; ``_tickets`` holds ids of requests the engine
    has not allocated yet and whose next first allocation includes their state sets; ``_admitted``
    (the facade's) the host hits admitted at their match, waiting for that first allocation."""

    manager: HybridBlockManager
    _binding: tuple[bool, str] | None
    _tickets: set[RequestId]
    _admitted: set[RequestId]

    # ---- the engine contract --------------------------------------------------------------------
    def bind_engine(self, patch_series: str, *, cache_manager_v1: bool, splitwise_role: str = "mixed") -> None:
        """Patch E0 (end of ``ResourceManagerV1.__init__``): the engine says it runs :data:`PATCH_SERIES`,
        in which cache-manager mode (``enable_cache_manager_v1``) and splitwise role. Raises
        :class:`EnginePatchError` for another series, ``ValueError`` / ``TypeError`` for a bad mode
        (a bool, or the int 0 / 1 that develop's ``enable_cache_manager_v1`` holds) or role,
        ``RequestStateError`` once bound (nothing changes then)."""
        if patch_series != PATCH_SERIES:
            raise EnginePatchError(
                f"bind_engine: the engine runs patch series {patch_series!r}, this facade answers {PATCH_SERIES!r} "
                "(docs/fastdeploy.md): apply that series to FastDeploy"
            )
        # develop c1b7c083 sets enable_cache_manager_v1 from the env value ENABLE_V1_KVCACHE_MANAGER (0 or 1)
        if not (isinstance(cache_manager_v1, bool) or is_integer(cache_manager_v1) and cache_manager_v1 in (0, 1)):
            raise TypeError(f"bind_engine: cache_manager_v1 must be a bool or 0 / 1, got {cache_manager_v1!r}")
        cache_manager_v1 = bool(cache_manager_v1)
        if splitwise_role not in SPLITWISE_ROLES:
            raise ValueError(f"bind_engine: splitwise_role must be one of {SPLITWISE_ROLES}, got {splitwise_role!r}")
        if self._binding is not None:
            raise RequestStateError("bind_engine: an engine is bound to this facade already")
        self._binding = (cache_manager_v1, splitwise_role)

    def _require(self, call: str) -> None:
        if self._binding is None:
            raise EnginePatchError(
                f"{call}: no engine bound this facade. FastDeploy's ResourceManagerV1 runs over hybridkv only with "
                f"the patch series {PATCH_SERIES!r} (docs/fastdeploy.md); its E0 line, "
                "cache_manager.bind_engine(PATCH_SERIES, cache_manager_v1=..., splitwise_role=...) at the end of "
                "ResourceManagerV1.__init__, is missing"
            )

    def _role(self) -> str:
        return "mixed" if self._binding is None else self._binding[1]

    def state_blocks_for(self, request: Any) -> int:
        """Patch E2: what the engine adds to a request's block need where it admits the request (the
        WAITING and PREEMPTED branches of ``schedule()``, ``preallocate_resource_in_p`` / ``_in_d``):
        :attr:`num_state_blocks_per_request` for a request the engine has not allocated yet (no
        blocks, or a host hit admitted at its match, whose state sets wait for that first
        allocation), else 0. The call is the request's ticket: its first ``allocate_gpu_blocks``
        takes the state sets out of its count. Tickets lapse at :meth:`begin_step` and on release."""
        self._require("state_blocks_for")
        rid = getattr(request, "request_id", None)
        if rid is None:
            raise TypeError(f"state_blocks_for needs a request with request_id, got {type(request).__name__}")
        if rid in self.manager.requests and rid not in self._admitted:
            return 0
        self._tickets.add(rid)
        return self.manager.num_state_blocks


def allocation_args(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bool, RequestId, int]:
    """``(is_v1, request_id, num_blocks)`` of an ``allocate_gpu_blocks`` call; raises before any change."""
    unknown = sorted(set(kwargs) - {"num_blocks", "req_id", "request"})
    if unknown or len(args) > 2:
        what = f"unexpected keyword {', '.join(unknown)}" if unknown else f"{len(args)} positional arguments"
        raise TypeError(f"allocate_gpu_blocks: {what}; use {ALLOCATE_FORMS}")
    first = args[0] if args else kwargs.get("request", kwargs.get("num_blocks"))
    v1 = "request" in kwargs or (not is_integer(first) and hasattr(first, "request_id"))
    if v1:
        if "req_id" in kwargs:
            raise TypeError(f"allocate_gpu_blocks: the v1 form takes no req_id; use {ALLOCATE_FORMS}")
        names = ("request", "num_blocks")
    elif is_integer(first):
        if "request" in kwargs:
            raise TypeError(f"allocate_gpu_blocks: the legacy form takes no request; use {ALLOCATE_FORMS}")
        names = ("num_blocks", "req_id")
    else:
        raise TypeError(
            f"allocate_gpu_blocks: {first!r} ({type(first).__name__}) is neither a block count nor a "
            f"request; use {ALLOCATE_FORMS}"
        )
    bound = dict(zip(names, args, strict=False))
    for name in names:
        if name in kwargs:
            if name in bound:
                raise TypeError(f"allocate_gpu_blocks: {name} given twice; use {ALLOCATE_FORMS}")
            bound[name] = kwargs[name]
    if "num_blocks" not in bound:
        raise TypeError(f"allocate_gpu_blocks: num_blocks missing; use {ALLOCATE_FORMS}")
    num_blocks = bound["num_blocks"]
    if not is_integer(num_blocks):
        raise TypeError(
            f"allocate_gpu_blocks: num_blocks must be an integer, got {num_blocks!r} "
            f"({type(num_blocks).__name__}); use {ALLOCATE_FORMS}"
        )
    # a negative count is 0, as FastDeploy's managers take it (range(n) is empty): develop c1b7c083's
    # get_new_block_nums can return one for a request holding more blocks than its tokens need
    count = max(int(num_blocks), 0)
    rid = bound["request"].request_id if v1 else bound.get("req_id")
    if rid is None:
        raise RequestStateError(
            "allocate_gpu_blocks needs req_id: blocks belong to a request here. FastDeploy's "
            "ResourceManagerV1 passes request.request_id; see docs/fastdeploy.md"
        )
    try:
        hash(rid)
    except TypeError:
        raise TypeError(f"allocate_gpu_blocks: request id {rid!r} is not hashable") from None
    return v1, rid, count
