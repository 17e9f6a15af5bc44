"""The logged model: an MLflow pyfunc that scores raw rows (a DataFrame of the schema's columns).

What is logged is what a serving system needs: the model weights, the schema and the model
config; and beside them, for a job that starts from this model (``train.init_from``,
:mod:`models.warm`), both optimisers' state (``train_state.pt``, which scoring never reads).
Scoring runs the same reader code as training (dense transform, hashing, null buckets), so a
row scores the same online as in evaluation.

This module's path is part of every model logged: MLflow pickles :class:`RankingModel` by
reference, so ``pipeline.serving`` stays where it is (at the top of ``pipeline/``, whatever the
folders around it) or every champion logged before the move stops loading.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import torch
import yaml
from mlflow.models import ModelSignature
from mlflow.models.model import ModelInfo
from mlflow.pyfunc.model import PythonModel, PythonModelContext
from mlflow.types.schema import AnyType, ColSpec, DataType, TensorSpec
from mlflow.types.schema import Schema as MlflowSchema

from antdt import __version__
from antdt.errors import DataError
from data.files import RowGroup, open_parquet
from data.reader import table_batch
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.train_step import TrainStep
from models.warm import TRAIN_STATE_FILE, WEIGHTS_FILE
from pipeline.job.config import JobConfig

EXAMPLE_ROWS = 5


class RankingModel(PythonModel):
    """Scores a DataFrame of raw feature columns; returns click probabilities, shape ``(rows,)``."""

    def load_context(self, context: PythonModelContext) -> None:
        spec = yaml.safe_load(Path(context.artifacts["spec"]).read_text())
        self.schema = Schema.from_dict(spec["schema"], source="logged model schema")
        model_cfg = ModelConfig.from_dict(spec["model"], where="logged model")
        optim_cfg = OptimConfig.from_dict(spec["optim"], where="logged model")
        self.step = TrainStep(self.schema, model_cfg, optim_cfg, device=torch.device("cpu"))
        weights = torch.load(context.artifacts["weights"], map_location="cpu", weights_only=True)
        self.step.model.load_state_dict(weights)

    def predict(self, context: PythonModelContext, model_input: pd.DataFrame,
                params: dict[str, Any] | None = None) -> np.ndarray:
        return score_frame(self.step, self.schema, model_input)


def score_frame(step: TrainStep, schema: Schema, frame: pd.DataFrame) -> np.ndarray:
    """Click probabilities of the raw rows in ``frame`` (a label column, if any, is ignored)."""
    table = _conform(pa.Table.from_pandas(frame, preserve_index=False), schema)
    if schema.label not in table.column_names:
        table = table.append_column(schema.label, pa.array(np.zeros(len(table), np.int8)))
    batch = table_batch(table, schema, where="model input")
    return step.predict(batch).cpu().numpy()


def _conform(table: pa.Table, schema: Schema) -> pa.Table:
    """Undo pandas' int-with-nulls -> float64 for integer id columns (a non-integral value in
    such a column raises, naming the column, rather than being truncated)."""
    for feature in schema.sparse:
        if feature.type != "int" or feature.multi_valued or feature.name not in table.column_names:
            continue
        index = table.schema.get_field_index(feature.name)
        if pa.types.is_floating(table.schema.field(index).type):
            try:
                column = table.column(index).cast(pa.int64())
            except pa.ArrowInvalid as exc:
                raise DataError(f"model input column {feature.name!r}: expected integer ids, "
                                f"found non-integral values ({exc})") from exc
            table = table.set_column(index, feature.name, column)
    return table


def example_rows(group: RowGroup, schema: Schema) -> pd.DataFrame:
    """A few raw rows of ``group`` (the features only) as the model's input example."""
    features = [c for c in schema.columns if c != schema.label]
    with open_parquet(group.path) as parquet:
        table: pa.Table = parquet.read_row_group(group.index, columns=features)
    return table.slice(0, EXAMPLE_ROWS).to_pandas()


def input_schema(frame: pd.DataFrame) -> MlflowSchema:
    """The model's input columns, all optional (nulls are valid input and go to null buckets).

    Float and string columns are typed. Integer and list columns are declared ``Any``: pandas
    turns an integer column with a null into float64 and MLflow will not convert int64 to
    float64, so no single MLflow type accepts every valid input; ``score_frame`` checks those
    columns itself and names the column when a value is not an integer.
    """
    specs: list[ColSpec | TensorSpec] = []
    for name, dtype in frame.dtypes.items():
        kind: DataType | AnyType
        if pd.api.types.is_float_dtype(dtype):
            kind = DataType.double
        elif pd.api.types.infer_dtype(frame[name], skipna=True) == "string":
            kind = DataType.string
        else:
            kind = AnyType()
        specs.append(ColSpec(kind, str(name), required=False))
    return MlflowSchema(specs)


def log_ranking_model(step: TrainStep, schema: Schema, job: JobConfig, example: RowGroup
                      ) -> ModelInfo:
    """Log ``step``'s model as an MLflow pyfunc (with signature and input example) to the active
    run; what MLflow says of it (its ``models:/<id>`` URI). Registering it is
    :mod:`pipeline.tracking.registry`'s, once the run's figures are known to tag the version
    with."""
    frame = example_rows(example, schema)
    with tempfile.TemporaryDirectory(prefix="antdt-model-") as tmp:
        spec_path = Path(tmp) / "spec.yaml"
        spec_path.write_text(yaml.safe_dump({"schema": schema.to_dict(),
                                             "model": job.model.to_dict(),
                                             "optim": job.train.optim.to_dict()}))
        weights_path = Path(tmp) / WEIGHTS_FILE
        torch.save({k: v.detach().cpu() for k, v in step.model.state_dict().items()}, weights_path)
        train_state_path = Path(tmp) / TRAIN_STATE_FILE
        torch.save(step.optimizer_state(), train_state_path)
        output = MlflowSchema([TensorSpec(np.dtype(np.float32), (-1,))])
        signature = ModelSignature(inputs=input_schema(frame), outputs=output)
        info: ModelInfo = mlflow.pyfunc.log_model(
            name="model", python_model=RankingModel(),
            artifacts={"spec": str(spec_path), "weights": str(weights_path),
                       "train_state": str(train_state_path)},
            signature=signature, input_example=frame,
            pip_requirements=[f"antdt=={__version__}"],
        )
    return info
