"""Workloads the scheduler data generator (tests/test_scheduler_data.py) found failing, pinned as
replays: each fails on the code before its fix."""
from hybridkv.blockmgr.prefix import CheckpointPolicy, EvictionPolicy, PrefixCacheConfig
from hybridkv.scheduler_adapter import AdmissionPolicy, PreemptionMode
from tests.test_scheduler_data import run_data_workload


def test_a_vllm_align_request_that_cannot_hold_its_checkpoint_beside_its_sets_is_refused_not_livelocked():
    """Found by this generator at 4,000 examples: under vllm_align, a lone request whose checkpoint set
    (pinned until its copy runs) and own live and speculative sets fill the pool preempted itself at
    every step for ever. It is now refused at add_request (RequestTooLargeError), and the rest run."""
    run_data_workload(kind='mixed', actions=[
        ('add', 2, 2, 1, 0, 0),
        ('add', 9, 6, 0, 0, 0),
        ('add', 2, 4, 0, 0, 0),
        ('add', 12, 3, 0, 0, 0),
        ('add', 12, 5, 0, 0, 0),
        ('add', 11, 1, 0, 0, 0),
        ('add', 7, 1, 0, 0, 0),
        ('add', 5, 6, 0, 0, 0),
        ('fork', 616, 1, 1),
        ('add', 5, 6, 0, 0, 0),
        ('fork', 31, 1, 3),
        ('step', None),
        ('step', None),
        ('fork', 184, 2, 3),
        ('step', None),
        ('step', None),
        ('fork', 31, 1, 3),
        ('step', None),
        ('step', None),
        ('fork', 155, 1, 3),
        ('fork', 18, 1, 1),
        ('step', None),
        ('step', None),
        ('fork', 272, 1, 3),
        ('step', None),
        ('fork', 257, 2, 2),
        ('step', None),
        ('fork', 122, 2, 3),
        ('step', None),
        ('step', None),
        ('fork', 519, 2, 1),
        ('step', None),
        ('fork', 693, 2, 3),
        ('step', None)],
        mode=PreemptionMode.AUTO, k=1, admission=AdmissionPolicy.RESERVED,
        num_blocks=23, num_host_blocks=16, host_tier=True, watermark=0.0,
        max_num_seqs=6, max_tokens=6,
        prefix=PrefixCacheConfig(CheckpointPolicy.VLLM_ALIGN, EvictionPolicy.LRU, 2,
                                 evict_batch_fraction=0.01, demote_tail=False),
        sync_swaps=True, run_aborted=True, accept_rate=0.25998818054209877,
        seed=6312, second_batch=[(970, 19, 1, 1)], second_config=(5, 7, 1), cancel_at_end=True)


def test_export_sets_reserved_for_one_row_are_counted_before_the_next_row_grows():
    """Found at 3,000 examples: the step's O(1) bound said every running row fits, then one row's
    prefill exports (sets reserved inside its chunk) took the last free blocks and the next row's
    append raised NoFreeBlocksError out of step(). Rows after one that reserves exports or a
    checkpoint copy are now checked one by one (and preempt what they must)."""
    run_data_workload(
        kind='uniform',
        actions=[('add', 1, 1, 0, 0, 0), ('add', 4, 4, 0, 1, 24), ('add', 9, 1, 0, 1, 16),
                 ('fork', 0, 1, 2), ('step', None), ('step', None), ('fork', 0, 1, 1),
                 ('fork', 0, 1, 1), ('step', None)],
        mode=PreemptionMode.RECOMPUTE, k=0, admission=AdmissionPolicy.RESERVED,
        num_blocks=41, num_host_blocks=0, host_tier=False, watermark=0.0,
        max_num_seqs=3, max_tokens=21,
        prefix=PrefixCacheConfig(CheckpointPolicy.BRANCH_AND_LAST, EvictionPolicy.LRU, 1,
                                 evict_batch_fraction=0.01, demote_tail=False, export_alignment=4),
        sync_swaps=False, run_aborted=False, accept_rate=0.0, seed=0, second_batch=[],
        second_config=(1, 4, 0), cancel_at_end=False)
