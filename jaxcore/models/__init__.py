"""Flax models of the recipes, one module per recipe name."""
