"""Calibration: the tracer, covariance statistics, OSCAR rotations, clip search and artifacts."""

from .artifacts import ArtifactError, Artifacts, load_artifacts
from .check import check_layers, select_bf16_layers
from .retrieval_heads import induction_scores, select_retrieval_heads, with_retrieval_heads
from .rotations import DEFAULT_METHOD, MethodSpec, parse_method
from .tracer import CalibrationStats, calibrate, collect_statistics, derive_artifacts, token_batches

__all__ = ["calibrate", "check_layers", "select_bf16_layers", "induction_scores", "select_retrieval_heads",
           "with_retrieval_heads", "collect_statistics", "derive_artifacts", "CalibrationStats", "token_batches", "Artifacts", "ArtifactError", "load_artifacts", "parse_method", "MethodSpec",
           "DEFAULT_METHOD"]
