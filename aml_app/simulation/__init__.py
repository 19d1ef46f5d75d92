"""Simulated payment traffic with injected laundering typologies, its ground truth and its scoring."""
