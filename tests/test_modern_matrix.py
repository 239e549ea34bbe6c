"""The modern-architecture matrix (benchmarks/bench_modern_matrix.py, kiln_testing/modern_matrix.py).

The matrix itself is a benchmark (minutes of compiling; results in docs/benchmarks.md). This
checks the parts that decide what it reports: the checkpoints are what their families claim
(a sliding window shorter than the sequence, grouped-query heads, a padded tail the source
ignores), an artifact is compared with transformers' own output and a wrong one is caught,
and every cell is named ok, wrong, engine limit or bug.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kiln_testing import modern_matrix as mx
from kiln_testing import modern_models as mm


def test_the_ten_families_are_distinct_architectures_at_their_tasks(tmp_path: Path) -> None:
    assert len(mm.SCORED) == 10 and len(set(mm.SCORED)) == 10
    assert {f.task for f in mm.FAMILIES} == {
        "causal-lm",
        "causal-lm-with-past",
        "sequence-classification",
        "image-classification",
        "feature-extraction",
    }
    types = {}
    for key in ("mistral", "llama", "modernbert"):
        path = mm.build_checkpoint(mm.family(key), tmp_path)
        assert {"config.json", "model.safetensors"} <= {p.name for p in path.iterdir()}
        types[key] = json.loads((path / "config.json").read_text())
    assert types["mistral"]["sliding_window"] == mm.WINDOW < min(mx.OPEN_LENGTHS)
    assert types["llama"]["num_key_value_heads"] < types["llama"]["num_attention_heads"]
    assert types["modernbert"]["local_attention"] == mm.WINDOW


def test_the_source_ignores_the_padded_tail_and_the_window_cuts(tmp_path: Path) -> None:
    bert = mm.family("modernbert")
    path = mm.build_checkpoint(bert, tmp_path)
    feed = mm.feeds(bert, path, sequence=12)
    assert feed["attention_mask"][0, -3:].tolist() == [0, 0, 0]
    changed = {k: v.copy() for k, v in feed.items()}
    changed["input_ids"][0, -1] = (changed["input_ids"][0, -1] + 1) % mm.VOCAB
    a, b = mm.source_outputs(bert, path, feed), mm.source_outputs(bert, path, changed)
    np.testing.assert_allclose(a["logits"], b["logits"], atol=1e-6)  # a padded token changes nothing

    mistral = mm.family("mistral")
    path = mm.build_checkpoint(mistral, tmp_path)
    feed = mm.feeds(mistral, path, sequence=20)
    changed = {k: v.copy() for k, v in feed.items()}
    changed["input_ids"][0, 0] = (changed["input_ids"][0, 0] + 1) % mm.VOCAB
    a, b = mm.source_outputs(mistral, path, feed), mm.source_outputs(mistral, path, changed)
    # Outside the window of the first token, two layers of 8 reach 14 positions: the last ones do not see it.
    np.testing.assert_allclose(a["logits"][0, -1], b["logits"][0, -1], atol=1e-6)
    assert np.abs(a["logits"][0, 1] - b["logits"][0, 1]).max() > 1e-4


def test_an_artifact_is_checked_against_transformers_at_the_lengths_it_serves(tmp_path: Path) -> None:
    fam = mm.family("llama")
    path = mm.build_checkpoint(fam, tmp_path)

    def faithful(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return mm.source_outputs(fam, path, feed)

    def off(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"logits": faithful(feed)["logits"] * 1.01}

    open_axes = mx.LoadedArtifact(
        "x", {"": mx.Signature({"input_ids": [1, None], "attention_mask": [1, None]}, faithful)}
    )
    good = mx.check_artifact(fam, path, open_axes)
    assert good["ok"] and good["lengths"] == list(mx.OPEN_LENGTHS) and good["max_rel"] < 1e-6
    fixed = mx.LoadedArtifact("x", {"": mx.Signature({"input_ids": [1, 16], "attention_mask": [1, 16]}, off)})
    bad = mx.check_artifact(fam, path, fixed)
    assert not bad["ok"] and bad["lengths"] == [16] and 0.009 < bad["max_rel"] < 0.011
    assert "max relative error" in bad["problem"]


@pytest.mark.parametrize(
    ("cell", "kind"),
    [
        ({"status": "succeeded", "check": {"ok": True, "lengths": [12, 20]}}, "ok"),
        ({"status": "succeeded", "check": {"ok": False, "problem": "max relative error 1e-1"}}, "wrong"),
        ({"status": "failed", "code": "CONVERSION_FAILED", "message": "x"}, "engine limit"),
        ({"status": "failed", "code": "PARITY_FAILED", "message": "y"}, "bug"),
    ],
)
def test_every_cell_is_named(cell: dict[str, object], kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mx, "ENGINE_LIMITS", {("swin", "ncnn", "CONVERSION_FAILED"): "no such layer"})
    monkeypatch.setattr(mx, "KNOWN_BUGS", {})
    assert mx.verdict("swin", "ncnn", cell)[0] == kind
    rows = [{"family": "swin", "cells": {"ncnn": cell}}]
    md = mx.markdown(rows, ["ncnn"])
    want = {"ok": "ok (any length)", "wrong": "**wrong**", "engine limit": "limit", "bug": "**bug**"}[kind]
    assert want in md.splitlines()[2]
    assert f"| **of the ten families** | | {int(kind == 'ok')}/1 |" in md
    if kind == "bug":
        assert "unexplained (a bug until named): y" in md
