"""Tests of GPU discovery and health, on recorded nvidia-smi and NVML outputs."""
