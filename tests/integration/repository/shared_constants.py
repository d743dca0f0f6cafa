"""Imported by augment.py: a file of the repository may import its siblings."""

OFFSET = 1000
