"""Analyses of the models, and the code the analysis tools share: the tools and the tests import it; it imports
no tool and reads nothing of the checkout (a tool passes its paths in)."""
