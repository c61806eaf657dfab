"""Building attention metadata from Python lists."""

from engine.attention import AttentionMetadata


def test_metadata_from_lists() -> None:
    md = AttentionMetadata.from_lists([18, 5], [2, 5], [[3, 7], [2]], block_size=16)
    assert md.positions.tolist() == [16, 17, 0, 1, 2, 3, 4]
    assert md.slot_mapping.tolist() == [7 * 16, 7 * 16 + 1, 32, 33, 34, 35, 36]
    assert md.query_start_loc.tolist() == [0, 2, 7]
    assert md.logits_indices.tolist() == [1, 6]
    assert md.block_tables.tolist() == [[3, 7], [2, 0]]
    assert (md.max_query_len, md.max_seq_len) == (5, 18)
