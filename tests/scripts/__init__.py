"""Tests of scripts/: the benchmarks' logic on the CPU (test_<script>.py) and the folder's layout rules."""
