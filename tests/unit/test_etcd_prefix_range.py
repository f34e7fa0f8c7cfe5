"""The end of the etcd key range that holds every key under a prefix (etcd's own rule)."""

from elasticd.store.etcd import _prefix_end


def test_the_range_of_a_prefix_ends_at_its_last_byte_raised():
    assert _prefix_end(b"elasticd/c/rdzv/j-abcdef/") == b"elasticd/c/rdzv/j-abcdef0"
    assert _prefix_end(b"a\xfe") == b"a\xff"
    assert _prefix_end(b"a\xff\xff") == b"b"  # the bytes at 0xff cannot be raised: dropped
    assert _prefix_end(b"\xff") == b"\0"  # etcd's "every key from here on"
