"""Building attention metadata from Python lists."""

import torch

from kvgate.engine.attention import AttentionMetadata


def test_metadata_from_lists() -> None:
    md = AttentionMetadata.from_lists([18, 5], [2, 5], [[3, 7], [2]], block_size=16)
    assert md.positions.tolist() == [16, 17, 0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [7 * 16, 7 * 16 + 1, 32, 33, 34, 35, 36]
    assert md.query_start_loc.tolist() == [0, 2, 7]
    assert md.block_tables.tolist() == [[3, 7], [2, 0]]
    assert (md.max_query_len, md.max_seq_len) == (5, 18)


def test_last_queries_are_one_token_queries_over_each_whole_context() -> None:
    md = AttentionMetadata.from_lists([18, 5, 40], [2, 5, 1], [[3, 7], [2], [4, 5, 6]], 16)
    last = md.last_queries(torch.tensor([0, 2]), max_seq_len=40)
    assert last.positions.tolist() == [17, 39]
    assert last.query_start_loc.tolist() == [0, 1, 2]
    assert last.seq_lens.tolist() == [18, 40]
    assert last.block_tables.tolist() == [[3, 7, 0], [4, 5, 6]]
    assert last.slot_mapping.tolist() == [-1, -1]  # their K/V are written by the whole step
    assert (last.max_query_len, last.max_seq_len) == (1, 40)
