import numpy as np
import pytest

from andrea.store.checkpoint import checkpoint_bytes, read_checkpoint, read_header, write_checkpoint
from andrea.common.errors import AndreaError


def state(n, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(3)]


def test_round_trip_and_exact_layout(tmp_path):
    path = tmp_path / "m.ckpt"
    params, m, v = state(1000)
    write_checkpoint(path, 42, params, m, v)
    raw = path.read_bytes()
    assert len(raw) == 8 + 12 * 1000 == checkpoint_bytes(1000)
    assert np.frombuffer(raw[:8], "<i4").tolist() == [42, 1000]
    np.testing.assert_array_equal(np.frombuffer(raw[8:4008], "<f4"), params)
    np.testing.assert_array_equal(np.frombuffer(raw[8 + 8000:], "<f4"), v)
    step, p2, m2, v2 = read_checkpoint(path, 1000)
    assert step == 42
    for a, b in ((params, p2), (m, m2), (v, v2)):
        assert a.tobytes() == b.tobytes()
    assert not list(tmp_path.glob(".*tmp*"))  # no temp file left behind


def test_truncated_file_rejected(tmp_path):
    path = tmp_path / "t.ckpt"
    write_checkpoint(path, 1, *state(100))
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(AndreaError, match=r"t\.ckpt: not a checkpoint.*truncated"):
        read_checkpoint(path)


def test_oversized_file_rejected(tmp_path):
    path = tmp_path / "o.ckpt"
    write_checkpoint(path, 1, *state(100))
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(AndreaError, match=r"o\.ckpt: not a checkpoint"):
        read_header(path)


def test_wrong_model_rejected(tmp_path):
    path = tmp_path / "w.ckpt"
    write_checkpoint(path, 1, *state(100))
    with pytest.raises(AndreaError, match=r"w\.ckpt: checkpoint holds 100 parameters but .* has 135,808"):
        read_checkpoint(path, 135_808)


def test_tiny_and_non_checkpoint_files_rejected(tmp_path):
    (tmp_path / "a.ckpt").write_bytes(b"abc")
    with pytest.raises(AndreaError, match="too short"):
        read_header(tmp_path / "a.ckpt")
    (tmp_path / "b.ckpt").write_text("hello world, not a checkpoint at all")
    with pytest.raises(AndreaError, match="not a checkpoint"):
        read_header(tmp_path / "b.ckpt")
    with pytest.raises(AndreaError, match="not found"):
        read_header(tmp_path / "missing.ckpt")


def test_failed_write_keeps_previous_checkpoint(tmp_path):
    path = tmp_path / "k.ckpt"
    write_checkpoint(path, 1, *state(100))
    before = path.read_bytes()
    params, m, _ = state(100, seed=1)

    class FailsMidWrite:
        """Half the file is already written when this raises, like a full disk would."""
        size = 100

        def __array__(self, dtype=None, copy=None):
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_checkpoint(path, 2, params, m, FailsMidWrite())
    assert path.read_bytes() == before
    assert not list(tmp_path.glob(".*tmp*"))
