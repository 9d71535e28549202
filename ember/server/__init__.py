"""The OpenAI-compatible HTTP server behind `ember serve`."""
