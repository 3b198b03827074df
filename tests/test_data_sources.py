"""Several sources: tokenize per source plus their union, the loader's one index space over the
sources (no window crosses a source, same batches as the single-shard scheme for one shard), loss
weights aligned with targets, and lineage from any shard back to its raw source."""

import json
import shutil

import numpy as np
import pytest

from andrea.cli import main
from andrea.store.loader import TokenWindows
from andrea.store.manifest import lineage, lineage_ok, read_manifest
from andrea.store.shards import mask_path, mask_writer, read_mask, read_shard, write_shard


class SingleShardWindows:
    """The loader as it was for one shard (before sources), kept as the reference."""

    def __init__(self, path, seq_len, seed=0):
        self.tokens = read_shard(path)
        self.seq_len, self.seed = seq_len, seed
        self.n_windows = (self.tokens.size - 1) // seq_len
        self._perm_epoch, self._perm = -1, None

    def _window(self, sample):
        epoch, index = divmod(sample, self.n_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.Generator(np.random.PCG64([self.seed, epoch])).permutation(self.n_windows)
            self._perm_epoch = epoch
        return int(self._perm[index])

    def _gather(self, windows):
        T = self.seq_len
        rows = np.stack([np.asarray(self.tokens[w * T: w * T + T + 1], dtype=np.int32) for w in windows])
        return rows[:, :-1].copy(), rows[:, 1:].copy()

    def train_micro_batches(self, step, batch_size, micro_batches, rank=0, world=1):
        share = batch_size // world
        first = step * batch_size + rank * share
        x, y = self._gather([self._window(first + i) for i in range(share)])
        return list(zip(np.split(x, micro_batches), np.split(y, micro_batches)))

    def val_batch(self, index, batch_size):
        first = index * batch_size
        return self._gather([(first + i) % self.n_windows for i in range(batch_size)])


def shard_with_mask(path, tokens):
    write_shard(path, tokens)
    with mask_writer(mask_path(path)) as append:
        append(tokens % 2)


def test_one_shard_gives_the_batches_it_always_gave(tmp_path):
    tokens = np.random.default_rng(3).integers(0, 512, 10_007)
    write_shard(tmp_path / "train.bin", tokens)
    new, old = TokenWindows(tmp_path / "train.bin", 32, seed=7), SingleShardWindows(tmp_path / "train.bin", 32, seed=7)
    assert new.n_windows == old.n_windows == 312 and new.sources == [None]
    for step in list(range(45)) + [77, 200]:  # 8 x 45 samples cross the first epoch's end
        for rank, world in ((0, 1), (1, 2)):
            for (x, y), (xo, yo) in zip(new.train_micro_batches(step, 8, 2, rank, world),
                                        old.train_micro_batches(step, 8, 2, rank, world)):
                assert np.array_equal(x, xo) and np.array_equal(y, yo)
    for index in (0, 5, 38):
        (x, y), = new.micro_batches_of(list(range(index * 8, index * 8 + 8)), 1)
        xo, yo = old.val_batch(index, 8)
        assert np.array_equal(x, xo) and np.array_equal(y, yo)


@pytest.fixture
def three_sources(tmp_path):
    """Sources whose tokens lie in disjoint ranges, so a row shows which source it came from."""
    sizes = {"alpha": 3_301, "beta": 650, "gamma": 9_000}
    for k, (name, n) in enumerate(sizes.items()):
        (tmp_path / name).mkdir()
        shard_with_mask(tmp_path / name / "train.bin", k * 1000 + np.arange(n) % 997)
    return tmp_path, sizes


def test_windows_of_all_sources_share_one_index_space(three_sources):
    folder, sizes = three_sources
    T = 16
    windows = TokenWindows(folder / "train.bin", T, seed=1)
    per_source = [(n - 1) // T for n in sizes.values()]
    assert windows.sources == ["alpha", "beta", "gamma"] and windows.n_windows == sum(per_source)
    seen = np.zeros(3, dtype=int)
    steps = windows.n_windows // 8
    for step in range(steps):
        (x, y), = windows.train_micro_batches(step, 8, 1)
        sources = windows.train_sources(step, 8)
        for row_x, row_y, source in zip(x, y, sources):
            assert set(np.unique(np.concatenate([row_x, row_y])) // 1000) == {source}, "no window crosses a source"
            seen[source] += 1
    assert all(abs(seen[k] - per_source[k]) <= 8 for k in range(3)), "an epoch draws each source by its tokens"
    again = TokenWindows(folder / "train.bin", T, seed=1)
    assert all(np.array_equal(a, b) for a, b in zip(again.train_micro_batches(steps - 1, 8, 2)[1],
                                                    windows.train_micro_batches(steps - 1, 8, 2)[1]))
    assert windows.tokens.size == sum(sizes.values())
    assert np.array_equal(np.asarray(windows.tokens)[3_300:3_302], windows.tokens[3_300:3_302])


def test_weights_are_the_masks_at_the_targets(three_sources):
    folder, _ = three_sources
    windows = TokenWindows(folder / "train.bin", 16, seed=2)
    assert windows.has_masks
    for step in (0, 9, 31):
        for (_, y), w in zip(windows.train_micro_batches(step, 8, 2), windows.train_micro_weights(step, 8, 2)):
            assert w.shape == y.shape and np.array_equal(w, y % 2)
    chosen = windows.val_windows(4)
    (_, y), = windows.micro_batches_of(chosen, 1)
    assert np.array_equal(windows.micro_weights_of(chosen, 1)[0], y % 2)


def write_source(path, name, n):
    rows = [{"conversations": [{"from": "human", "value": f"{name} question {i}?"},
                               {"from": "gpt", "value": f"The {name} answer number {i} is {i * 7}.", "weight": i % 2}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    """Two sources through the real CLI: pull and prep each, one tokenizer on both, tokenize both."""
    root = tmp_path_factory.mktemp("sources")
    sources = {"zeta": 300, "able": 200}
    for name, n in sources.items():
        raw = write_source(root / f"{name}.jsonl", name, n)
        data = root / "sources" / name
        assert main(["pull-hermes3", "--source", str(raw), "--out", str(data / "hermes3.parquet")]) == 0
        assert main(["prep-megachat", "--in", str(data / "hermes3.parquet"), "--out-dir", str(data / "megachat"),
                     "--val-fraction", "0.2"]) == 0
    out = root / "tokens-V300"
    train_ins = [a for name in sources for a in ("--in", str(root / "sources" / name / "megachat" / "train.parquet"))]
    assert main(["train-tokenizer", *train_ins, "--vocab-size", "300", "--out", str(out / "tokenizer.json")]) == 0
    source_args = [a for name in sources for a in ("--source", f"{name}={root / 'sources' / name / 'megachat'}")]
    assert main(["tokenize", "--tokenizer", str(out / "tokenizer.json"), "--out-dir", str(out), *source_args]) == 0
    return out


def test_tokenize_writes_each_source_and_their_union(tokens):
    for split in ("train", "val"):
        parts = [np.asarray(read_shard(tokens / name / f"{split}.bin")) for name in ("able", "zeta")]
        union = np.asarray(read_shard(tokens / f"{split}.bin"))
        assert np.array_equal(union, np.concatenate(parts)), "the union is the sources in name order"
        masks = [np.asarray(read_mask(mask_path(tokens / name / f"{split}.bin"))) for name in ("able", "zeta")]
        assert np.array_equal(read_mask(mask_path(tokens / f"{split}.bin"), union.size), np.concatenate(masks))
        manifest = read_manifest(tokens / f"{split}.bin")
        assert manifest["config"]["sources"] == ["able", "zeta"]
        assert [i["path"] for i in manifest["inputs"]] == [f"able/{split}.bin", f"zeta/{split}.bin"]
    trained = TokenWindows(tokens / "train.bin", 8)
    assert trained.sources == ["able", "zeta"]
    assert trained.tokens.size == read_shard(tokens / "train.bin").size


def test_lineage_walks_every_shard_back_to_its_raw_source(tokens, capsys):
    for shard in (tokens / "train.bin", tokens / "zeta" / "val.bin", mask_path(tokens / "able" / "train.bin")):
        root = lineage(shard)
        assert lineage_ok(root)
        assert main(["lineage", str(shard)]) == 0
    out = capsys.readouterr().out
    assert "zeta.jsonl" in out and "able.jsonl" in out and "[pull-hermes3]" in out
    tokenizer = read_manifest(tokens / "tokenizer.json")
    assert [i["path"] for i in tokenizer["inputs"]] == ["../sources/zeta/megachat/train.parquet",
                                                          "../sources/able/megachat/train.parquet"]


def test_a_folder_left_from_an_earlier_configuration_is_not_read(tokens, tmp_path):
    copy = tmp_path / "tokens"
    shutil.copytree(tokens, copy)
    shutil.copytree(copy / "zeta", copy / "old")
    assert TokenWindows(copy / "train.bin", 8).sources == ["able", "zeta"]


def test_bad_source_arguments_fail_clearly(tokens, capsys):
    base = ["tokenize", "--tokenizer", str(tokens / "tokenizer.json"), "--out-dir", str(tokens)]
    for extra, words in ((["--source", "nameonly"], "NAME=MEGACHAT_DIR"),
                         (["--source", "a=x", "--source", "a=y"], "given twice"),
                         (["--source", "../up=x"], "a source name is"),
                         (["--source", "a=x", "--in-dir", "y"], "not both")):
        assert main(base + extra) == 2
        assert words in capsys.readouterr().err
