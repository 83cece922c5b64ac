"""The patch-series orchestrator (moecache-build). Not named `build`: wheel and sdist tools
skip folders of that name."""
