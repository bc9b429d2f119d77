"""Torch twins of the recipe models: standard layers, the export target of each recipe."""
