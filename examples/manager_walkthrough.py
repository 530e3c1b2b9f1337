"""A walk through the hybrid block manager on MiniMax-M1 (TP8, fp32 state, 64-token blocks).

Runs on any machine (numpy only):  python examples/manager_walkthrough.py
"""

from __future__ import annotations

from hybridkv.blockmgr.manager import HybridBlockManager
from hybridkv.blockmgr.prefix import PrefixCacheConfig
from hybridkv.models.presets import preset
from hybridkv.planner.layout import plan

GiB = 1024**3


def show(m: HybridBlockManager, title: str) -> None:
    u = m.usage()
    print(
        f"{title:46s} free {u.free:6d}  KV {u.kv_live:5d}  state {u.state_live:4d}  spec {u.state_speculative:3d}"
        f"  cached KV {u.kv_cached:4d}  checkpoints {u.checkpoints:4d}  host {u.host_used}"
    )


def main() -> None:
    layout = plan(preset("minimax-m1", "float32", tp_size=8), 4 * GiB, block_size=64)
    print(layout.describe())
    m = HybridBlockManager(layout, num_host_blocks=2048, prefix_cache=PrefixCacheConfig())
    prompt = list(range(1000))  # token ids

    a = m.allocate("a", len(prompt), token_ids=prompt)
    print(f"admit a: {m.blocks_to_admit(len(prompt))} blocks, cached tokens {a.num_cached_tokens}")
    show(m, "a admitted (16 KV + 7 state sets of 16)")
    m.append("a", 24)  # decode: KV grows, the state sets never do
    state = m.state_table(["a"])  # [num_state_groups, B, blocks_per_state]
    print("a's state set of group 0:", state[0, 0].tolist())

    copies = m.fork("a", "b")  # KV shared by reference count, state copied
    show(m, f"fork a -> b ({len(copies)} state blocks to copy)")
    m.free("b")

    m.begin_speculation("a", 2)  # two speculative state sets
    m.append("a", 3)  # verify: the sampled token + 2 drafts
    m.commit_speculation("a", num_accepted=1)  # speculative set 0 becomes live, no copy
    show(m, "after speculation (1 of 2 drafts accepted)")

    plan_out = m.swap_out("a")
    print(f"swap out a: {len(plan_out)} device->host block copies (KV and state alike)")
    plan_out.commit()
    show(m, "a swapped out")
    m.swap_in("a").commit()
    show(m, "a swapped back in")
    m.free("a")

    # prefix caching: prefill a request in chunks that end where the policy wants a checkpoint. The
    # default policy (branch_spaced) keeps a state only where it saves enough recompute for its bytes
    # (a MiniMax-M1 TP8 state weighs as much as 7,168 tokens of KV): a 3,000-token prompt gets one at
    # 2,560 (its end rounded down to 512), a 1,000-token one would get none
    long_prompt = list(range(3000))
    m.allocate("c", 64, token_ids=long_prompt)
    while m.requests["c"].num_tokens < len(long_prompt):
        stop = m.next_checkpoint_position("c") or len(long_prompt)
        m.append("c", stop - m.requests["c"].num_tokens)
        m.checkpoint("c")  # the executor copies live -> checkpoint before the next forward
    m.free("c")
    show(m, "c finished: its KV and checkpoint stay cached")
    follow_up = long_prompt + list(range(5000, 5100))
    hit = m.allocate("d", len(follow_up), token_ids=follow_up)
    print(f"d hits {hit.num_cached_tokens} of {len(follow_up)} tokens; {len(hit.copies)} state blocks to copy")
    m.check_integrity()


if __name__ == "__main__":
    main()
