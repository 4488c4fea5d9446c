"""Glue between dsv41 and inference engines.  Nothing here is imported by ``import dsv41``."""
