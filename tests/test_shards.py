import numpy as np
import pytest

from andrea.common.errors import AndreaError
from andrea.store.loader import TokenWindows
from andrea.store.shards import HEADER_BYTES, MAGIC, mask_path, mask_writer, read_mask, read_shard, shard_writer, write_shard


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


@pytest.mark.parametrize("value", [2, 255])
def test_a_mask_value_other_than_0_or_1_is_refused_when_the_shards_are_opened(tmp_path, value):
    """A mask holds 0 or 1 (the writer refuses anything else); a file changed since is refused before its values
    weigh a loss, naming the first position outside."""
    tokens = np.arange(1_000) % 97
    write_shard(tmp_path / "val.bin", tokens)
    with mask_writer(mask_path(tmp_path / "val.bin")) as append:
        append(tokens % 2)
    with open(mask_path(tmp_path / "val.bin"), "r+b") as f:
        for position in (700, 900):
            f.seek(HEADER_BYTES + position)
            f.write(bytes([value]))
    message = rf"val\.mask\.bin: mask value {value} at token position 700 is not 0 or 1; rerun `andrea tokenize`"
    for chunk in (1 << 24, 64):  # one piece, or the eleventh of sixteen
        with pytest.raises(AndreaError, match=message):
            read_mask(mask_path(tmp_path / "val.bin"), tokens.size, chunk=chunk)
    with pytest.raises(AndreaError, match=message):
        TokenWindows(tmp_path / "val.bin", 16)
