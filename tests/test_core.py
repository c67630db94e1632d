"""Pieces under the loop: KV cache buffers, shapes and flag validation, the registry, artifacts on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from nndf.errors import UsageError
from nndf.kvcache import KVCache, past_names, present_names
from nndf.loading import known_config
from nndf.registry import FAMILIES, get_spec
from nndf.spec import BuildSettings, ShapeSpec
from nndf.workspace import (artifact_lock, artifact_name, atomic_dir, atomic_write_json, read_metadata,
                            write_artifact)


def test_kv_cache_stores_only_new_positions_in_place():
    cache = KVCache(num_layers=2, rows=3, kv_heads=2, head_dim=4, max_len=10)
    buffers_before = {n: b.data_ptr() for n, b in cache.buffers.items()}
    presents = {n: torch.randn(3, 2, 6, 4) for n in present_names(2)}
    cache.store(presents, 6)
    assert cache.length == 6
    step = {n: torch.cat([p, torch.randn(3, 2, 1, 4)], dim=2) for n, p in presents.items()}
    step["present.1.value"][:, :, :6] = 99.0  # a backend's copy of old positions is not read back
    cache.store(step, 7)
    assert cache.length == 7
    feeds = cache.past_feeds()
    assert set(feeds) == set(past_names(2))
    torch.testing.assert_close(feeds["past_key_values.1.value"][:, :, :6], presents["present.1.value"])
    torch.testing.assert_close(feeds["past_key_values.0.key"][:, :, 6], step["present.0.key"][:, :, 6])
    assert {n: b.data_ptr() for n, b in cache.buffers.items()} == buffers_before


def test_kv_cache_reorder_follows_beams():
    cache = KVCache(num_layers=1, rows=3, kv_heads=1, head_dim=2, max_len=4)
    rows = torch.arange(3, dtype=torch.float).view(3, 1, 1, 1).expand(3, 1, 2, 2)
    cache.store({"present.0.key": rows, "present.0.value": rows + 10}, 2)
    cache.reorder(torch.tensor([2, 2, 0]))
    keys = cache.past_feeds()["past_key_values.0.key"][:, 0, 0, 0]
    assert keys.tolist() == [2.0, 2.0, 0.0]
    assert cache.past_feeds()["past_key_values.0.value"][:, 0, 1, 1].tolist() == [12.0, 12.0, 10.0]


def test_kv_cache_overflow_is_an_error():
    cache = KVCache(num_layers=1, rows=1, kv_heads=1, head_dim=1, max_len=2)
    with pytest.raises(ValueError, match="holds 2 positions"):
        cache.store({"present.0.key": torch.zeros(1, 1, 3, 1), "present.0.value": torch.zeros(1, 1, 3, 1)}, 3)


def test_a_reserved_row_appends_in_place_and_equals_concatenation():
    """`TokenState.reserve`: one row's tokens and mask grow in buffers made once (the same values as concatenating,
    contiguous, the prompt copied rather than aliased); past the room, after the tokens are replaced, and for
    several rows (whose views would not be contiguous), appends concatenate as before."""
    from nndf.decoder import TokenState

    prompt, mask = torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 1]])
    reserved, plain = TokenState(prompt, mask), TokenState(prompt.clone(), mask.clone())
    reserved.reserve(5)
    buffer = reserved.tokens.data_ptr()
    for token in (8, 9, 10):
        for state in (reserved, plain):
            state.append(torch.tensor([token]))
        assert torch.equal(reserved.tokens, plain.tokens) and torch.equal(reserved.mask, plain.mask)
        assert reserved.tokens.is_contiguous() and reserved.mask.is_contiguous()
    assert prompt.tolist() == [[5, 6, 7]] and reserved.tokens.shape == (1, 6)
    assert reserved._room[0].data_ptr() == buffer  # grew in place up to the room, then concatenated
    assert reserved.tokens.data_ptr() != buffer
    replaced = TokenState(prompt, mask)
    replaced.reserve(10)
    replaced.replace_tokens(torch.tensor([[1, 2, 3]]))
    replaced.append(torch.tensor([4]))
    assert replaced.tokens.tolist() == [[1, 2, 3, 4]] and replaced.mask.tolist() == [[0, 1, 1, 1]]
    rows = TokenState(torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    rows.reserve(10)
    rows.append(torch.tensor([1, 2]))
    assert rows._room is None and rows.tokens[:, -1].tolist() == [1, 2] and rows.tokens.is_contiguous()


def test_shape_spec_from_settings():
    spec = get_spec("GPT2")
    config = known_config(spec.variant("gpt2-medium"))
    settings = BuildSettings(batch_size=2, num_beams=3, input_seq_len=100, output_seq_len=28, dynamic_batch=True,
                             min_dynamic_batch=1, max_dynamic_batch=4)
    shapes = ShapeSpec.derive(settings, spec, config)
    assert (shapes.rows.min, shapes.rows.opt, shapes.rows.max) == (3, 6, 12)
    assert shapes.prompt.max == 100 and shapes.total.max == 128
    assert (shapes.num_layers, shapes.kv_heads, shapes.head_dim, shapes.vocab_size) == (24, 16, 64, 50257)
    assert shapes.kv_shape(6, 128) == (6, 16, 128, 64)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(batch_size=0), "^batch_size must be at least 1, got 0$"),
        (dict(num_beams=0), "^num_beams must be at least 1"),
        (dict(dynamic_batch=True, min_dynamic_batch=5, max_dynamic_batch=3, batch_size=4),
         r"^min_dynamic_batch \(5\) must not exceed max_dynamic_batch \(3\)$"),
        (dict(dynamic_batch=True, min_dynamic_batch=2, max_dynamic_batch=3, batch_size=8),
         "^batch_size=8 must lie within min_dynamic_batch=2 and max_dynamic_batch=3$"),
        (dict(input_seq_len=0), "^input_seq_len must be at least 1"),
    ],
)
def test_build_settings_validation(kwargs, message):
    with pytest.raises(UsageError, match=message):
        BuildSettings(**kwargs)


def test_sequence_longer_than_positions_is_rejected():
    spec = get_spec("gpt2")
    config = known_config(spec.default_variant)
    with pytest.raises(UsageError, match="1025 tokens, more than the 1024 positions"):
        ShapeSpec.derive(BuildSettings(input_seq_len=1000, output_seq_len=25), spec, config)


def test_registry_knows_gpt2_variants_and_their_configs():
    assert "GPT2" in FAMILIES
    spec = get_spec("gpt2")
    expected = {"gpt2": (12, 768), "gpt2-medium": (24, 1024), "gpt2-large": (36, 1280), "gpt2-xl": (48, 1600)}
    for name, (layers, width) in expected.items():
        variant = spec.variant(name)
        assert variant.hub_id == f"openai-community/{name}"
        config = known_config(variant)
        assert (config.n_layer, config.n_embd, config.n_positions) == (layers, width, 1024)
    assert spec.variant("OPENAI-COMMUNITY/GPT2-LARGE").name == "gpt2-large"


def test_random_weights_are_seeded_and_offline(monkeypatch):
    """`--random-weights` needs no hub: the same seed gives the same weights (checked on a shrunk config)."""
    from nndf import loading
    from nndf.spec import Variant

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = get_spec("gpt2")
    small = Variant("tiny", "none/tiny", dict(spec.default_variant.config, n_layer=1, n_embd=16, n_head=2), "")
    a = loading.load_model(spec, small, random_weights=True, seed=3).model
    b = loading.load_model(spec, small, random_weights=True, seed=3).model
    assert torch.equal(a.transformer.h[0].attn.c_attn.weight, b.transformer.h[0].attn.c_attn.weight)


def test_artifacts_are_atomic_and_carry_metadata(tmp_path):
    settings = {"fp16": False, "batch": 4}
    name = artifact_name("decoder", settings, ".onnx")
    assert name != artifact_name("decoder", dict(settings, fp16=True), ".onnx")
    target = tmp_path / name

    def failing_build(path):
        path.write_bytes(b"half")
        raise RuntimeError("exporter crashed")

    with pytest.raises(RuntimeError):
        write_artifact(target, failing_build, {"settings": settings})
    assert list(tmp_path.iterdir()) == []
    write_artifact(target, lambda p: p.write_bytes(b"graph"), {"settings": settings})
    assert target.read_bytes() == b"graph"
    assert read_metadata(target) == {"settings": settings, "size": 5}
    atomic_write_json(tmp_path / "x.json", {"a": 1})
    assert json.loads((tmp_path / "x.json").read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, name + ".meta.json", "x.json"])
    umask = os.umask(0)
    os.umask(umask)
    with atomic_dir(tmp_path / "export") as folder:  # a working dir shared between users: new files and folders
        (folder / "graph.onnx").write_bytes(b"graph")  # get the permissions the umask gives, not mkstemp's private ones
    assert (tmp_path / "export").stat().st_mode & 0o777 == 0o777 & ~umask
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_writers_of_one_folder_at_once_all_succeed_and_leave_one_whole_folder(tmp_path):
    """Two `triton -o` (or `export -o`) runs on one output replace the same folder at once: removing the old folder,
    then renaming, failed one of them with "Directory not empty" or a FileNotFoundError about once in three."""
    final, failures = tmp_path / "model", []

    def write(writer: int) -> None:
        for _ in range(50):
            try:
                with atomic_dir(final) as folder:
                    for part in range(3):
                        (folder / f"part{part}").write_text(str(writer))
            except OSError as exc:
                failures.append(exc)

    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # nothing moved aside is left
    assert len({(final / f"part{part}").read_text() for part in range(3)}) == 1  # one writer's folder, whole


@pytest.mark.skipif(sys.platform == "win32", reason="flock is POSIX")
def test_a_second_process_waits_for_the_artifact_being_built_then_finds_it(tmp_path):
    """Two processes that want one artifact of a shared working dir: the one that comes second waits (and says so)
    until the first has built it, instead of building it too and replacing the folder the first reads."""
    folder = tmp_path / "GPT2-gpt2-decoder-0123456789ab"
    builder = textwrap.dedent(f"""
        import time, pathlib
        from nndf.workspace import artifact_lock
        folder = pathlib.Path({str(folder)!r})
        with artifact_lock(folder):
            (folder.parent / "locked").touch()
            time.sleep(2)
            folder.mkdir()
            (folder / "decoder.onnx").write_text("graph")
    """)
    first = subprocess.Popen([sys.executable, "-c", builder])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "locked").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first process never took the lock"
            time.sleep(0.02)
        said = []
        with artifact_lock(folder, said.append):
            assert (folder / "decoder.onnx").read_text() == "graph"  # built by the first, found by the second
        assert said == [f"waiting for another process that is building {folder} ..."]
        with artifact_lock(folder, said.append):  # free now: taken at once, nothing said
            pass
        assert len(said) == 1
    finally:
        first.wait(timeout=60)
    assert first.returncode == 0
    assert not list(tmp_path.glob(".*.lock")), "the lock file is removed by its last holder"


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL and flock are POSIX")
def test_a_build_killed_outright_leaves_its_temporary_folder_until_the_next_lock(tmp_path):
    """SIGKILL runs no cleanup: the half-built `.NAME.<random>.tmp` folder stays, and the next process that takes the
    artifact's lock (the only one that may build it) removes it and the killed metadata write's file, but never the
    temporary files of another artifact whose name starts with the same text."""
    folder = tmp_path / "GPT2-gpt2-decoder-0123456789ab"
    killed = textwrap.dedent(f"""
        import os, pathlib, signal
        from nndf.workspace import artifact_lock, atomic_dir, atomic_path, metadata_path
        folder = pathlib.Path({str(folder)!r})
        with artifact_lock(folder), atomic_dir(folder) as tmp, atomic_path(metadata_path(folder)) as meta:
            (tmp / "decoder.onnx").write_text("half a graph")
            meta.write_text("{{")
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert subprocess.run([sys.executable, "-c", killed]).returncode == -9
    leftovers = sorted(p.name for p in tmp_path.glob(".*.tmp"))
    assert len(leftovers) == 2 and all(name.startswith(f".{folder.name}.") for name in leftovers)
    other = tmp_path / f".{folder.name}-int8-0123456789ab.abcd1234.tmp"  # another artifact's build, in flight
    other.mkdir()
    with artifact_lock(folder):
        assert sorted(p.name for p in tmp_path.glob(".*.tmp")) == [other.name]
    assert not folder.exists()


def test_random_weights_are_built_on_their_device_and_named_by_it():
    """--random-weights builds the model where it will run (seeded; tests/test_random_weights.py compares the
    weights with `from_config`'s), and weights drawn on another device get their own identity (so an export of
    them is never mistaken for the CPU-drawn one)."""
    from family_examples import FAMILY_EXAMPLES
    from nndf.loading import load_model
    from nndf.spec import Variant

    spec = get_spec("GPT2")
    tiny = Variant.of("test/tiny-gpt2", "0.1M", FAMILY_EXAMPLES["GPT2"])
    loaded = load_model(spec, tiny, random_weights=True, device="cpu", seed=3)
    assert {tensor.device.type for tensor in loaded.model.state_dict().values()} == {"cpu"}
    elsewhere = load_model(spec, tiny, random_weights=True, device="cuda", seed=3)  # weights not drawn until used
    assert elsewhere.weights_id == loaded.weights_id + ":built-on-cuda" and elsewhere._model is None


def test_growing_kv_cache_keeps_the_presents_as_they_are():
    from nndf.kvcache import GrowingKVCache

    cache = GrowingKVCache(num_layers=1, rows=3, kv_heads=1, head_dim=2, max_len=5)
    assert cache.past_feeds()["past_key_values.0.key"].shape == (3, 1, 0, 2)
    rows = torch.arange(3, dtype=torch.float).view(3, 1, 1, 1).expand(3, 1, 2, 2).contiguous()
    presents = {"present.0.key": rows, "present.0.value": rows + 10}
    cache.store(presents, 2)
    assert cache.length == 2 and cache.past_feeds()["past_key_values.0.key"] is rows  # no copy
    cache.reorder(torch.tensor([2, 2, 0]))
    assert cache.past_feeds()["past_key_values.0.value"][:, 0, 0, 0].tolist() == [12.0, 12.0, 10.0]
    with pytest.raises(ValueError, match="holds 5 positions"):
        cache.store(presents, 6)


def test_position_ids_from_a_column_on_equal_the_whole_rows_count():
    """`FamilyHooks.position_ids(mask, start)` is the whole computation's columns from `start` on, the decode
    step's shortcut (one new column) included, for left padding, a padded last column and bool or int32 masks."""
    from nndf.spec import FamilyHooks

    hooks = FamilyHooks()
    masks = [torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]),
             torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]), torch.ones(1, 1, dtype=torch.long)]
    for mask in masks:
        for dtype in (torch.long, torch.int32, torch.bool):
            typed = mask.to(dtype)
            whole = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
            for start in range(mask.shape[1]):
                got = hooks.position_ids(typed, start)
                assert got.dtype == torch.long and torch.equal(got, whole[:, start:]), (mask, dtype, start)
