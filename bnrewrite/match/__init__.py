"""Matching: find batch-norm sites and line them up across towers."""
