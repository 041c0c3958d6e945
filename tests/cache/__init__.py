"""Tests of the result cache and of model residency (issue 4)."""
