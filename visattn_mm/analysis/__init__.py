"""Analyses of the models that tools and tests share (they import no tool)."""
