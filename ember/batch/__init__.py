"""Batch jobs: OpenAI Batch API files through the engine (`ember run-batch`, `LLM.run_batch`); see docs/batch.md."""
