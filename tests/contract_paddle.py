"""The Paddle runners' contract (tests/engine_contract.py), in a pytest process of its own.

Run by tests/test_paddle.py::test_runner_contract_in_a_process_of_its_own: Paddle cannot share
a process with the other engines' tests (see that test). Collected only when named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_contract import RunnerContract
from test_paddle import models  # noqa: F401 - the module fixture that builds the Paddle models


class TestPaddlePIRRunner(RunnerContract):
    fmt = "paddle_pir"
    output_names = ("fetch_name_0", "fetch_name_1")  # a PIR program names its fetches by position

    @pytest.fixture
    def model(self, models: Path) -> Path:  # noqa: F811 - the imported fixture, by name
        return models / "contract_pir" / "model.json"


class TestPaddleProgramRunner(RunnerContract):
    fmt = "paddle"
    output_names = ("tmp_1", "tmp_3")  # the ProgramDesc's own variable names, in fetch order

    @pytest.fixture
    def model(self, models: Path) -> Path:  # noqa: F811 - the imported fixture, by name
        return models / "contract_pdmodel" / "model.pdmodel"
