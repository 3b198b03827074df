"""The workflow's data folders are named by what defines them, and a local source that cannot be read
fails the planning: dry runs of the real `snakemake` CLI in a temporary copy of the workflow."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

from test_workflow import copy_workflow, edit_config, snakemake

pytestmark = pytest.mark.slow
CHATS = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'


def sources(workdir: Path) -> list[dict]:
    return yaml.safe_load((workdir / "config" / "config.yaml").read_text())["data"]["sources"]


def folders(workdir: Path) -> tuple[str, dict[str, str]]:
    """ANDREA-tiny's token folder and each source's pull folder under the workdir's config, from one
    dry run (the train job's --data, the pulls' --out)."""
    proc = snakemake(workdir, "--dry-run", "--printshellcmds", "--forcerun", "pull_hermes3", "results/ANDREA-tiny.ckpt")
    pulls = dict(re.findall(r"--out (results/data/sources/([A-Za-z0-9._-]+)-[0-9a-f]{12})/hermes3.parquet", proc.stdout))
    return re.search(r"andrea train .*--data (\S+)", proc.stdout).group(1), {n: f for f, n in pulls.items()}


def test_token_folder_is_named_by_the_data_config(tmp_path):
    workdir = copy_workflow(tmp_path)
    folder, pulls = folders(workdir)
    assert re.fullmatch(r"results/data/tokens-V512-[0-9a-f]{12}", folder)
    assert folders(workdir) == (folder, pulls), "the same config, the same folders"
    default = sources(workdir)
    edit_config(workdir, data={"sources": default[:1]})  # one source fewer, the same V
    fewer, fewer_pulls = folders(workdir)
    assert fewer != folder and fewer_pulls == {default[0]["name"]: pulls[default[0]["name"]]}
    edit_config(workdir, data={"sources": default, "val_fraction": 0.1})  # a prep setting: the same pulls
    other, other_pulls = folders(workdir)
    assert other not in (folder, fewer) and other_pulls == pulls


def test_a_local_sources_bytes_name_its_folders(tmp_path):
    workdir = copy_workflow(tmp_path)
    chats = workdir / "chats.jsonl"
    chats.write_bytes(CHATS)
    edit_config(workdir, data={"sources": [{"name": "mine", "source": "chats.jsonl"}]})
    first = folders(workdir)
    # other bytes of the same size at the same modification time
    stat = chats.stat()
    chats.write_bytes(CHATS.replace(b"hello", b"HELLO"))
    os.utime(chats, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert chats.stat().st_size == stat.st_size
    folder, pulls = folders(workdir)
    assert folder != first[0] and pulls["mine"] != first[1]["mine"]
    chats.write_bytes(CHATS)
    assert folders(workdir) == first, "the bytes name the folders, not the time"


@pytest.mark.parametrize("problem", ["missing", "directory", "unreadable"])
def test_an_unreadable_local_source_fails_the_dry_run(tmp_path, problem):
    if problem == "unreadable" and os.geteuid() == 0:
        pytest.skip("root reads a file without read permission")
    workdir = copy_workflow(tmp_path)
    path = {"missing": "data/chats.jsnol", "directory": "data", "unreadable": "data/chats.jsonl"}[problem]
    (workdir / "data").mkdir()
    (workdir / "data" / "chats.jsonl").write_bytes(CHATS)
    if problem == "unreadable":
        (workdir / path).chmod(0)
    edit_config(workdir, data={"sources": [*sources(workdir), {"name": "mine", "source": path}]})
    proc = snakemake(workdir, "--dry-run", check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Nothing to be done" not in output
    lines = [line for line in output.splitlines() if "'mine'" in line]
    assert len(lines) == 1, output
    assert path in lines[0] and lines[0].endswith(".") and ". " not in lines[0], lines[0]
    assert "Traceback" not in output
