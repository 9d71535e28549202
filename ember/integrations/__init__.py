"""Ember on other systems' serving layers (each an optional extra: `pip install ember[ray]`)."""
