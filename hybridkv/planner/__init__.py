"""The layout planner: a model description and a memory budget in, a concrete block layout out
(groups, layer slots, segment shapes, block bytes, blocks per state, waste). Stands on
:mod:`hybridkv.models`; the allocator (:mod:`hybridkv.blockmgr`) reads its :class:`Layout`."""
