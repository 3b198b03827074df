import numpy as np
import pytest

from andrea.errors import AndreaError
from andrea.shards import HEADER_BYTES, MAGIC, read_shard, shard_writer, write_shard


def test_streamed_shard_equals_whole_shard(tmp_path):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 65536, n) for n in (0, 7, 1000, 3)]
    with shard_writer(tmp_path / "streamed.bin") as append:
        for part in parts:
            append(part)
    write_shard(tmp_path / "whole.bin", np.concatenate(parts))
    assert (tmp_path / "streamed.bin").read_bytes() == (tmp_path / "whole.bin").read_bytes()
    header = np.fromfile(tmp_path / "whole.bin", dtype="<i4", count=3)
    assert header.tolist() == [MAGIC, 1, 1010]
    np.testing.assert_array_equal(read_shard(tmp_path / "streamed.bin"), np.concatenate(parts))
    assert (tmp_path / "whole.bin").stat().st_size == HEADER_BYTES + 2 * 1010


def test_a_failed_stream_keeps_the_previous_shard(tmp_path):
    path = tmp_path / "train.bin"
    write_shard(path, np.arange(10))
    before = path.read_bytes()
    with pytest.raises(AndreaError, match=r"train\.bin: token ids must lie in \[0, 65536\)"):
        with shard_writer(path) as append:
            append(np.arange(100))
            append(np.array([70000]))
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*tmp*"))
