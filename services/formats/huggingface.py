"""Hugging Face model directories (config.json + safetensors weights) as data, vetted.

A directory in the Hugging Face layout is code-adjacent: ``from_pretrained`` will unpickle a
``pytorch_model.bin`` and, with ``trust_remote_code``, import the ``modeling_*.py`` a config's
``auto_map`` names. Kiln reads none of that. :func:`vet_checkpoint` checks the directory
before transformers sees it: the config is bounded JSON without ``auto_map`` (or
``custom_pipelines``) at any depth, sub-configs included, weights are
safetensors whose headers parse and whose tensors lie inside their files, a sharded index
names only sibling ``.safetensors`` files, and nothing resolves outside the directory.
:func:`stage_checkpoint` then links just those files into a clean directory, the only one
transformers is ever given, so a pickle or a Python file beside them cannot be reached.

Nothing here imports transformers or torch: the API vets uploads without them.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, get_args

from services.descriptors.huggingface import Task
from services.errors import InvalidSpec, SourceUnreadable, UnsafeInput, UnsupportedFormat

__all__ = [
    "CONFIG_FILE",
    "TASKS",
    "WEIGHTS_INDEX",
    "HuggingFaceCheckpoint",
    "choose_task",
    "find_checkpoint_root",
    "is_checkpoint_dir",
    "members_look_like_checkpoint",
    "sniff",
    "sniff_members",
    "stage_checkpoint",
    "vet_checkpoint",
    "vetted_root",
]

CONFIG_FILE = "config.json"
WEIGHTS_INDEX = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
#: What Kiln compiles a checkpoint for (options.huggingface.task); the names say which head and which inputs/outputs.
TASKS: tuple[str, ...] = get_args(Task)
#: Weight files written as pickles (torch.save, joblib): never loaded. A bare ``.bin`` counts
#: only as ``pytorch_model*.bin``: OpenVINO IR exports (openvino_model.xml + .bin) sit beside a
#: config.json too, and are not checkpoints.
PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".joblib")


def _is_pickle(name: str) -> bool:
    return name.endswith(PICKLE_SUFFIXES) or (name.startswith("pytorch_model") and name.endswith(".bin"))


MAX_CONFIG_BYTES = 4 * 1024**2
MAX_SAFETENSORS_HEADER = 100 * 1024**2
SAFETENSORS_DTYPES = frozenset(
    {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"}
)
_SAFETENSORS_HINT = (
    "Save the model with safetensors (model.save_pretrained(dir), the default since transformers 4.35) "
    "and upload config.json with the .safetensors files."
)


@dataclass(frozen=True)
class HuggingFaceCheckpoint:
    """A vetted checkpoint directory: its config and the files transformers may read."""

    root: Path
    config: dict[str, Any]
    weights: tuple[str, ...]  # .safetensors file names in ``root``
    index: str | None = None  # model.safetensors.index.json when the weights are sharded
    extra: tuple[str, ...] = ()  # other files staged (generation_config.json)
    ignored: tuple[str, ...] = field(default=())  # files left out of the staged copy

    @property
    def model_type(self) -> str:
        return str(self.config["model_type"])

    @property
    def architectures(self) -> list[str]:
        archs = self.config.get("architectures") or []
        return [a for a in archs if isinstance(a, str)]


def _weight_files(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(".safetensors"))


def _pickles(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if p.is_file() and _is_pickle(p.name))


def is_checkpoint_dir(path: Path) -> bool:
    """Return True when ``path`` holds config.json beside model weights (safetensors or pickled)."""
    if not (path / CONFIG_FILE).is_file():
        return False
    return bool(_weight_files(path)) or (path / WEIGHTS_INDEX).is_file() or bool(_pickles(path))


def members_look_like_checkpoint(members: list[str]) -> bool:
    """Return True when archive members hold config.json and weights in one folder."""
    folders: dict[str, set[str]] = {}
    for m in members:
        parent, _, base = m.rstrip("/").rpartition("/")
        folders.setdefault(parent, set()).add(base)
    for bases in folders.values():
        if CONFIG_FILE in bases and any(b.endswith(".safetensors") or _is_pickle(b) for b in bases):
            return True
    return False


def sniff(path: Path) -> str | None:
    """Return what was seen when ``path`` is a checkpoint directory, else None (the format's ``detect``)."""
    if path.is_dir() and is_checkpoint_dir(path):
        return "Hugging Face checkpoint directory (config.json + weights)"
    return None


def sniff_members(members: list[str]) -> str | None:
    """Return what was seen when a zip's or tar's members hold a checkpoint, else None (``detect_archive``)."""
    if members_look_like_checkpoint(members):
        return "archive holding a Hugging Face checkpoint (config.json + weights)"
    return None


def vetted_root(root: Path) -> Path:
    """Return the checkpoint directory under ``root`` after vetting it (the format's ``loadable``).

    Pickles, ``auto_map`` and paths that leave the directory are refused here, when the source
    is opened (by the API at submission, by ``kiln compile`` before planning), before any job runs.
    """
    found = find_checkpoint_root(root)
    vet_checkpoint(found)
    return found


def find_checkpoint_root(root: Path) -> Path:
    """Return the shallowest directory under ``root`` (itself included) that holds a checkpoint."""
    if is_checkpoint_dir(root):
        return root
    candidates = sorted((p.parent for p in root.rglob(CONFIG_FILE)), key=lambda p: (len(p.parts), str(p)))
    for c in candidates:
        if is_checkpoint_dir(c):
            return c
    raise SourceUnreadable(f"no directory with {CONFIG_FILE} and weights in {root.name}", hint=_SAFETENSORS_HINT)


def _inside(root: Path, p: Path) -> None:
    # A directory given on the command line may hold symbolic links; what they point at must
    # stay in the directory (archives with links are refused when extracted).
    real_root = root.resolve()
    if not p.resolve().is_relative_to(real_root):
        raise UnsafeInput(f"{p.name} resolves outside the model directory", member=p.name)


def _read_json(path: Path, what: str) -> Any:
    size = path.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise SourceUnreadable(f"{what} {path.name} is {size} bytes, over the {MAX_CONFIG_BYTES}-byte limit")
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise SourceUnreadable(f"{what} {path.name} is not readable JSON: {exc}") from exc


#: Config keys that make transformers import code shipped with the model (trust_remote_code), at any depth.
CODE_KEYS = frozenset({"auto_map", "custom_pipelines"})
_CODE_HINT = (
    "Kiln never runs code shipped with a model (no trust_remote_code). Use an architecture "
    "transformers ships, or export the model yourself (torch.export .pt2, ONNX)."
)


def _code_key(doc: Any) -> tuple[str, Any] | None:
    """Return (path, value) of the first code-naming key anywhere in a JSON document, or None.

    Walked with a stack, not recursion: a composite model's sub-configs (``text_config``,
    ``vision_config``, ``encoder``...) are configs too, and each may name code.
    """
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{where}.{key}" if where else str(key)
                if key in CODE_KEYS:
                    return path, value
                stack.append((path, value))
        elif isinstance(node, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
    return None


def _refuse_code(doc: Any, file: str) -> None:
    found = _code_key(doc)
    if found is not None:
        path, value = found
        names = sorted(value)[:4] if isinstance(value, dict) else str(value)[:80]
        raise UnsafeInput(
            f"{file} has {path}: the model needs its own Python code ({names})",
            hint=_CODE_HINT,
            key=path,
        )


def _vet_config(path: Path) -> dict[str, Any]:
    config = _read_json(path, "the config")
    if not isinstance(config, dict):
        raise SourceUnreadable(f"{CONFIG_FILE} must hold a JSON object")
    _refuse_code(config, CONFIG_FILE)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise UnsupportedFormat(
            f"{CONFIG_FILE} has no model_type, so no transformers architecture can be built from it",
            hint="A Hugging Face config names its architecture in model_type (e.g. bert, gpt2, vit, t5).",
        )
    return config


def _vet_safetensors(path: Path) -> None:
    """Check a .safetensors header: bounded JSON whose tensors lie inside the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SourceUnreadable(f"{path.name} is too short to be a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_SAFETENSORS_HEADER, size - 8):
            raise SourceUnreadable(f"{path.name} is not a safetensors file (header length {n}, file {size} bytes)")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise SourceUnreadable(f"{path.name} is not a safetensors file: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise SourceUnreadable(f"{path.name}: safetensors header is not an object")
    data_bytes = size - 8 - n
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            raise SourceUnreadable(f"{path.name}: tensor {name!r} has no known dtype")
        offsets = info.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise SourceUnreadable(f"{path.name}: tensor {name!r} lies outside the file (truncated?)")


def _plain_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise SourceUnreadable(f"{what}: {name!r} is not a file name")
    p = PurePosixPath(name.replace("\\", "/"))
    if p.is_absolute() or len(p.parts) != 1 or ".." in p.parts:
        raise UnsafeInput(f"{what} names {name!r}, outside the model directory", member=name)
    return name


def _sharded_weights(root: Path) -> tuple[str, ...]:
    index = _read_json(root / WEIGHTS_INDEX, "the weight index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SourceUnreadable(f"{WEIGHTS_INDEX} has no weight_map")
    shards = sorted({_plain_name(v, WEIGHTS_INDEX) for v in weight_map.values()})
    for s in shards:
        if not s.endswith(".safetensors"):
            raise UnsafeInput(f"{WEIGHTS_INDEX} names {s!r}, which is not a safetensors file", hint=_SAFETENSORS_HINT)
        if not (root / s).is_file():
            raise SourceUnreadable(f"{WEIGHTS_INDEX} names the shard {s}, which is not in the directory")
    return tuple(shards)


def vet_checkpoint(path: Path) -> HuggingFaceCheckpoint:
    """Return the checkpoint in ``path`` after checking that it is data transformers may read.

    Raises UNSAFE_INPUT for pickled weights without safetensors, an ``auto_map`` (custom code),
    an index or link that leaves the directory; SOURCE_UNREADABLE for a broken config or
    weight file; UNSUPPORTED_FORMAT for a config that names no architecture.
    """
    root = Path(path)
    if not root.is_dir():
        raise SourceUnreadable(f"{root} is not a directory")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise SourceUnreadable(f"{root.name} has no {CONFIG_FILE}")
    _inside(root, config_path)
    config = _vet_config(config_path)
    index: str | None = None
    if (root / WEIGHTS_INDEX).is_file():
        _inside(root, root / WEIGHTS_INDEX)
        weights = _sharded_weights(root)
        index = WEIGHTS_INDEX
    else:
        files = [p.name for p in _weight_files(root)]
        # save_pretrained writes model.safetensors; adapters and extras may sit beside it.
        weights = ("model.safetensors",) if "model.safetensors" in files else tuple(files)
    if not weights:
        pickles = _pickles(root)
        if pickles:
            raise UnsafeInput(
                f"{root.name} holds only pickled weights ({', '.join(pickles[:3])}); Kiln never unpickles them",
                hint=_SAFETENSORS_HINT,
            )
        raise SourceUnreadable(f"{root.name} has {CONFIG_FILE} but no .safetensors weights", hint=_SAFETENSORS_HINT)
    for w in weights:
        _inside(root, root / w)
        _vet_safetensors(root / w)
    extra: tuple[str, ...] = ()
    gen = root / GENERATION_CONFIG
    if gen.is_file():
        _inside(root, gen)
        generation = _read_json(gen, "the generation config")
        if isinstance(generation, dict):
            _refuse_code(generation, GENERATION_CONFIG)
            extra = (GENERATION_CONFIG,)
    kept = {CONFIG_FILE, *weights, *extra, *([index] if index else [])}
    ignored = tuple(sorted(p.name for p in root.iterdir() if p.name not in kept))
    return HuggingFaceCheckpoint(root=root, config=config, weights=weights, index=index, extra=extra, ignored=ignored)


def stage_checkpoint(ckpt: HuggingFaceCheckpoint, dest: Path) -> Path:
    """Link the vetted files (and only those) into ``dest``; return ``dest`` for transformers to read."""
    dest.mkdir(parents=True, exist_ok=True)
    names = [CONFIG_FILE, *ckpt.weights, *ckpt.extra, *([ckpt.index] if ckpt.index else [])]
    for name in names:
        src = (ckpt.root / name).resolve()
        target = dest / name
        if target.exists() or target.is_symlink():
            target.unlink()
        try:
            os.link(src, target)
        except OSError:  # another filesystem: a symbolic link to the vetted file reads the same
            target.symlink_to(src)
    return dest


#: architecture class suffix -> task, checked in order.
_SUFFIX_TASKS = (
    ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
)


def choose_task(ckpt: HuggingFaceCheckpoint, requested: str | None) -> str:
    """Return the task to compile: the spec's, else the one the config's ``architectures`` name.

    A config naming no head (``BertModel``, ``T5EncoderModel``, ``ViTModel``) is compiled for
    feature extraction. Causal LMs default to the graph without past key values (one call
    over the whole sequence); ``causal-lm-with-past`` must be asked for.
    """
    if requested is not None:
        if requested not in TASKS:
            raise InvalidSpec(
                f"options.huggingface.task {requested!r} is not one Kiln compiles",
                hint="Tasks: " + ", ".join(TASKS) + ".",
                errors=[{"field": "options.huggingface.task", "problem": f"one of {', '.join(TASKS)}"}],
            )
        return requested
    for arch in ckpt.architectures:
        for suffix, task in _SUFFIX_TASKS:
            if arch.endswith(suffix):
                return task
    return "feature-extraction"
