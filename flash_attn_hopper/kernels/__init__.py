"""Pallas Mosaic GPU kernels (sm90). They assume canonical inputs: the api validates."""
