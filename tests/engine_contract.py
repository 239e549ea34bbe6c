"""The contract every runner and every exporter keeps, as test classes an engine subclasses.

The contract classes hold the tests (as tests/test_storage_contract.py does for storage);
an engine adds only a fixtures class, in its own test file or in tests/test_engine_contract.py:

    class TestTVMRunner(RunnerContract):
        fmt = "tvm_lib"

        @pytest.fixture
        def model(self, onnx_model: Path, tmp_path: Path) -> Path:
            ...  # write the contract model (onnx_model) in the format, return its path

    class TestTVMExporter(ExporterContract):
        target = "tvm"

The model is the same everywhere: inputs ``x`` and ``y`` (float32, batch x 4), outputs
``z_sum = x + y`` then ``a_prod = x * y``, declared in that order, which is not
alphabetical, so a runner that sorts its outputs is caught. Feeding 1e30 overflows the
product to +inf, and inf + -inf gives NaN: non-finite values must come back as they are.
A runner format that cannot hold this model (Hugging Face checkpoints) gives its own model,
inputs and expected outputs through ``RunnerContract``'s hooks.
tests/test_engine_contract.py fails when a registered runner or target has no such class.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from services.descriptors import registry
from services.formats import Format
from services.runners import ModelRunner, TensorSpec, open_runner

__all__ = [
    "BATCH",
    "FEATURES",
    "OUTPUTS",
    "ExporterContract",
    "RunnerContract",
    "contract_onnx",
    "expected",
    "importable",
    "nonfinite_feeds",
    "sample_feeds",
]

BATCH = 3
FEATURES = 4
OUTPUTS = ("z_sum", "a_prod")


def sample_feeds() -> dict[str, np.ndarray]:
    """Return seeded finite inputs x and y."""
    rng = np.random.default_rng(0)
    return {
        "x": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
        "y": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
    }


def nonfinite_feeds() -> dict[str, np.ndarray]:
    """Return inputs whose outputs hold +inf (a_prod[0, 0]), -inf (a_prod[1, 1]) and NaN (z_sum[1, 1])."""
    x = np.ones((BATCH, FEATURES), np.float32)
    y = np.ones((BATCH, FEATURES), np.float32)
    x[0, 0] = y[0, 0] = 1e30  # product overflows: +inf
    x[1, 1], y[1, 1] = np.inf, -np.inf  # sum: NaN; product: -inf
    return {"x": x, "y": y}


def expected(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Return the contract model's outputs for ``feeds``, computed with numpy."""
    x, y = feeds["x"], feeds["y"]
    with np.errstate(over="ignore", invalid="ignore"):
        return {"z_sum": x + y, "a_prod": x * y}


def importable(module: str) -> bool:
    """Return True when ``module`` can be imported here."""
    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- the contract model


def contract_onnx(path: Path) -> Path:
    """Write the contract model as ONNX (opset 17, dynamic batch)."""
    import onnx
    from onnx import TensorProto, helper

    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", FEATURES])

    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["z_sum"]), helper.make_node("Mul", ["x", "y"], ["a_prod"])],
        "contract",
        [vi("x"), vi("y")],
        [vi("z_sum"), vi("a_prod")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, path)
    return path


# --------------------------------------------------------------------------- runners


class RunnerContract:
    """What every ModelRunner promises; a subclass gives ``fmt`` and the ``model`` fixture.

    The model is the contract model. A format that cannot hold it (a Hugging Face checkpoint
    is one of the architectures transformers ships, not x + y) writes a small model of its
    own instead and overrides ``feeds``, ``nonfinite`` and ``expected``, computing the
    expected outputs without the runner; the tests stay the same.
    """

    fmt: ClassVar[str]
    #: Output names as the format stores them, in the model's order (formats that rename say so).
    output_names: ClassVar[tuple[str, ...]] = OUTPUTS
    #: Formats whose stored order is not the model's (a signature map) set this False.
    ordered: ClassVar[bool] = True
    #: Absolute and relative tolerance of the outputs against ``expected``.
    tolerance: ClassVar[float] = 1e-6

    def feeds(self, model: Path) -> dict[str, np.ndarray]:
        """Return seeded finite inputs for ``model``."""
        return sample_feeds()

    def nonfinite(self, model: Path) -> dict[str, np.ndarray]:
        """Return inputs for which ``model`` gives non-finite outputs."""
        return nonfinite_feeds()

    def expected(self, model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return the outputs ``model`` should give for ``feeds``, keyed by ``output_names``, computed without the runner."""
        return dict(zip(self.output_names, expected(feeds).values(), strict=True))

    @pytest.fixture(scope="class")
    def onnx_model(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The contract model as ONNX, which most formats are made from."""
        return contract_onnx(tmp_path_factory.mktemp("contract") / "model.onnx")

    @pytest.fixture
    def runner(self, model: Path) -> Any:
        r = open_runner(Format(self.fmt), model)
        yield r
        r.close()

    @staticmethod
    def _fits(t: TensorSpec, value: np.ndarray) -> None:
        assert t.dtype == value.dtype.name, t
        assert len(t.shape) == value.ndim and all(
            d is None or d == n for d, n in zip(t.shape, value.shape, strict=True)
        ), t

    def test_tensor_specs(self, runner: ModelRunner, model: Path) -> None:
        assert all(isinstance(t, TensorSpec) for t in [*runner.inputs, *runner.outputs])
        feeds = self.feeds(model)
        want = self.expected(model, feeds)
        assert sorted(t.name for t in runner.inputs) == sorted(feeds)
        assert sorted(t.name for t in runner.outputs) == sorted(self.output_names)
        for t in runner.inputs:
            self._fits(t, feeds[t.name])
        for t in runner.outputs:
            self._fits(t, want[t.name])
        io = runner.io_contract()
        assert [d["name"] for d in io["inputs"]] == [t.name for t in runner.inputs]
        assert [d["name"] for d in io["outputs"]] == [t.name for t in runner.outputs]

    def test_outputs_in_declared_order_with_the_right_values(self, runner: ModelRunner, model: Path) -> None:
        feeds = self.feeds(model)
        out = runner.run(feeds)
        assert list(out) == [t.name for t in runner.outputs]  # run() keeps self.outputs' order
        if self.ordered:
            assert [t.name for t in runner.outputs] == list(self.output_names)
        for name, want in self.expected(model, feeds).items():
            assert out[name].shape == want.shape and out[name].dtype == want.dtype, name
            np.testing.assert_allclose(out[name], want, rtol=self.tolerance, atol=self.tolerance)

    def test_nonfinite_outputs_come_back_as_they_are(self, runner: ModelRunner, model: Path) -> None:
        feeds = self.nonfinite(model)
        got = runner.run(feeds)
        want = self.expected(model, feeds)
        assert not all(np.isfinite(w).all() for w in want.values())  # the inputs do give NaN or infinities
        for name, w in want.items():
            np.testing.assert_array_equal(np.isnan(got[name]), np.isnan(w))
            inf = np.isinf(w)
            np.testing.assert_array_equal(np.isinf(got[name]), inf)
            np.testing.assert_array_equal(got[name][inf], w[inf])  # +inf stays +inf, -inf stays -inf

    def test_runs_again_after_a_run_and_closes_twice(self, model: Path) -> None:
        r = open_runner(Format(self.fmt), model)
        first = r.run(self.feeds(model))
        second = r.run(self.feeds(model))
        for name in first:
            np.testing.assert_array_equal(first[name], second[name])
        r.close()
        r.close()  # idempotent: exporters close in finally blocks that may run twice


class ExporterContract:
    """What every target's exporter promises for the contract model; a subclass names the target."""

    target: ClassVar[str]
    #: The artifact lists outputs in the source's order (TF signatures are maps: clients address them by name).
    ordered: ClassVar[bool] = True

    @pytest.fixture(scope="class")
    def onnx_model(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        """The contract model as ONNX, which most formats are made from."""
        return contract_onnx(tmp_path_factory.mktemp("contract") / "model.onnx")

    @pytest.fixture(scope="class")
    def compiled(self, onnx_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
        """Compile the contract model for this target (conversions cached across targets in one store)."""
        from services.pipeline import compile_model
        from services.repository import LocalModelRepository
        from services.spec import load_spec
        from services.storage import LocalArtifactStore

        reason = self.cannot_run_here().get(self.target)
        if reason:
            pytest.skip(reason)
        root = tmp_path_factory.getbasetemp() / "engine-contract"
        spec = load_spec({"targets": [self.target], "name": f"contract-{self.target}", "benchmark": False})
        return compile_model(
            onnx_model, spec, store=LocalArtifactStore(root / "store"), repository=LocalModelRepository(root / "repo")
        )

    @staticmethod
    def cannot_run_here() -> dict[str, str]:
        """Return the targets whose engine this machine lacks, with the reason."""
        out = {}
        for name, t in registry().targets.items():
            missing = [m for m in registry().engines[t.engine].modules if not importable(m)]
            if missing:
                out[name] = f"{', '.join(missing)} not installed here"
        return out

    @pytest.fixture
    def artifact(self, compiled: Any) -> Any:
        result = compiled.targets[self.target]
        assert result.status == "succeeded", result.error
        plan = compiled.plan
        export_id = plan.route_options(self.target)[0].export
        return compiled.steps[export_id].artifact

    def test_io_keeps_the_source_names_and_order(self, artifact: Any) -> None:
        io = artifact.meta["io"]  # read from the artifact itself
        inputs, outputs = [t["name"] for t in io["inputs"]], [t["name"] for t in io["outputs"]]
        if self.ordered:
            assert (inputs, outputs) == (["x", "y"], list(OUTPUTS))
        else:  # names kept, order the signature's own (TF Serving lists inputs y, x)
            assert (sorted(inputs), sorted(outputs)) == (["x", "y"], sorted(OUTPUTS))
        assert all(t["dtype"] == "float32" for t in [*io["inputs"], *io["outputs"]])
        parity = artifact.meta["parity"]
        assert parity["passed"] is True and [o["name"] for o in parity["outputs"]] == list(OUTPUTS)

    def test_artifact_runs_on_its_format_runner(self, artifact: Any) -> None:
        fmt = Format(registry().targets[self.target].artifact_format)
        assert artifact.kind == fmt.value
        runner = open_runner(fmt, Path(artifact.root) / (artifact.entry or ""))
        try:
            feeds = sample_feeds()
            out = runner.run(feeds)
            assert list(out) == [t.name for t in runner.outputs]
            for name, want in expected(feeds).items():
                np.testing.assert_allclose(out[name], want, rtol=1e-5, atol=1e-5)
            feeds = nonfinite_feeds()
            out = runner.run(feeds)
            for name, want in expected(feeds).items():
                np.testing.assert_array_equal(np.isfinite(out[name]), np.isfinite(want))
            assert np.isnan(out["z_sum"][1, 1]) and out["a_prod"][0, 0] == np.inf
        finally:
            runner.close()
            runner.close()
