"""The weights on 2 MB pages (engine.huge_pages): every large tensor of a loaded CPU model moved into one mapping
advised for transparent huge pages, tied and viewed tensors still sharing, the replies the same token for token as
with the weights left where they were read, and KVCHAT_HUGE_PAGES=0 leaving them there."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from checkpoints import make_checkpoint
from engine import huge_pages
from engine.session import Request, Session
from engine.weights.loading import load_model

needs_thp = pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages for advised memory here")


def _held(model: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in huge_pages._tensors(model) if t.untyped_storage().nbytes() >= huge_pages.SMALLEST]


def _region(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping holding `address`: its fields by name."""
    entry, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and ":" in line:
                key, value = line.split(":", 1)
                entry[key] = value.strip()
    return entry


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory):
    """A tiny Llama wide enough that its int4 MLP rows pass SMALLEST (256 x 1024 codes, 128 KB)."""
    return make_checkpoint(tmp_path_factory.mktemp("wide"), "llama", hidden_size=256, intermediate_size=1024)


def _greedy(loaded, n: int = 12) -> list[int]:
    session = Session(loaded, capacity=64)
    for ev in session.generate(Request(prompt_ids=(5, 9, 11, 3, 7), max_new_tokens=n, ignore_eos=True)):
        last = ev
    return list(last.token_ids)


@needs_thp
@pytest.mark.parametrize("weights", ["none", "int8", "int4"])
def test_a_loaded_model_lies_on_2_mb_pages_and_replies_as_it_did(wide_dir, monkeypatch, weights):
    monkeypatch.setenv(huge_pages.ENV, "0")
    where_read = load_model(wide_dir, device="cpu", dtype="float32", weights=weights, group_size=32)
    assert where_read.model.huge_page_bytes == 0 and "none moved" in where_read.facts()["weight_pages"]
    want = _greedy(where_read)
    monkeypatch.delenv(huge_pages.ENV)
    loaded = load_model(wide_dir, device="cpu", dtype="float32", weights=weights, group_size=32)
    held = _held(loaded.model)
    assert held, "the tiny model holds tensors of 64 KB and more"
    # one 2 MB-aligned stretch of one mapping holds them all, and the mapping is advised for huge pages
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1
    raw = held[0].untyped_storage().data_ptr()
    base, moved = raw + (-raw % huge_pages.HUGE), loaded.model.huge_page_bytes
    assert all(base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + moved for t in held)
    region = _region(base)
    assert region.get("THPeligible") == "1", region
    assert loaded.facts()["weight_pages"].startswith("2 MB (")
    assert _greedy(loaded) == want


def test_tied_weights_and_views_keep_sharing_and_their_values(monkeypatch):
    monkeypatch.setattr(huge_pages, "available", lambda: True)
    if not sys.platform.startswith("linux") or huge_pages.arena(1) is None:
        pytest.skip("no mapping advised for huge pages here (a kernel without transparent huge pages)")
    table = torch.nn.Embedding(512, 64)
    head = torch.nn.Linear(64, 512, bias=False)
    head.weight = table.weight  # tied
    model = torch.nn.ModuleDict({"table": table, "head": head})
    model.register_buffer("codes", torch.arange(40_000, dtype=torch.int32))
    model.rows = model.codes[100:30_000]  # a view kept as a plain attribute
    model.small = torch.ones(8)  # under SMALLEST: left where it is
    before = {k: v.clone() for k, v in [("w", table.weight), ("codes", model.codes), ("rows", model.rows)]}
    small_at = model.small.data_ptr()
    moved = huge_pages.gather(model.requires_grad_(False))
    assert moved == 512 * 64 * 4 + 40_000 * 4
    assert head.weight is table.weight and torch.equal(table.weight, before["w"])
    assert torch.equal(model.codes, before["codes"]) and torch.equal(model.rows, before["rows"])
    assert model.rows.data_ptr() == model.codes.data_ptr() + 100 * 4  # still a view of the moved buffer
    assert model.small.data_ptr() == small_at
    model.codes[150] = -1  # the view sees a write through its base
    assert int(model.rows[50]) == -1
    stored = {t.untyped_storage().data_ptr() for t in (table.weight, model.codes)}
    assert len(stored) == 1 and min(t.data_ptr() for t in (table.weight, model.codes)) % huge_pages.HUGE == 0


def test_off_by_the_environment_or_without_linux_nothing_moves(monkeypatch):
    model = torch.nn.Linear(256, 256)
    at = model.weight.data_ptr()
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.available() and huge_pages.gather(model) == 0 and model.weight.data_ptr() == at
    monkeypatch.setenv(huge_pages.ENV, "1")
    monkeypatch.setattr(huge_pages.sys, "platform", "darwin")
    assert not huge_pages.available() and huge_pages.gather(model) == 0 and model.weight.data_ptr() == at
    assert huge_pages.empty(1000).numel() == 1000  # the bench's buffer: torch's own memory there


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc")
@needs_thp
def test_the_bench_reads_its_roofline_from_2_mb_pages():
    x = huge_pages.empty(4 << 20)
    x.fill_(1.0)
    assert x.data_ptr() % huge_pages.HUGE == 0 and _region(x.data_ptr()).get("THPeligible") == "1"
