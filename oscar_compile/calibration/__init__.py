"""Calibration: tracer, covariance statistics, OSCAR rotations, artifacts."""
